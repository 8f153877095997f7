"""The reads of one reconcile pass: the job's pods and nodes from the API server, and each pod's
agent's status over its API. What they mean (leaving, gone, ready) is `observation`'s.

Agents are asked for their status in parallel, each call bounded, so one slow agent does not stall
the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from .agents import AgentClient, AgentError, ClientTls
from .kube import Kube
from .observation import Observation, Pod, gone, node_leaving, pod_of
from .render import JOB_LABEL, pod_members, serves_tls


def observe(
    kube: Kube,
    namespace: str,
    job: str,
    token: str,
    port: int,
    clients: dict[str, AgentClient],
    tls: Callable[[], ClientTls],
) -> Observation:
    """The job's pods and their members' agents' status; `clients` caches one client per
    member, over mutual TLS (`tls`, read when first needed) to every pod whose agent was given it
    (a client made with a pair `tls` no longer gives is made again)."""
    leaving_nodes = {n["metadata"]["name"] for n in kube.nodes() if node_leaving(n)}
    raw = kube.pods(namespace, f"{JOB_LABEL}={job}")
    seen = [(pod, member) for pod in raw for member in pod_members(pod)]
    for name in set(clients) - {member for _, member in seen}:
        clients.pop(name).close()

    def look(pod: dict[str, Any], member: str) -> Pod:
        name, ip = pod["metadata"]["name"], (pod.get("status") or {}).get("podIP")
        agent, error = None, ""
        if ip and not gone(pod):
            want = tls() if serves_tls(pod) else None
            client = clients.get(member)
            if client is not None and client.tls != want:  # the operator's pair was renewed
                client.close()
                client = None
            if client is None:
                client = clients[member] = AgentClient(
                    member, ip, port, token, timeout=3.0, tls=want
                )
            try:
                agent = client.status()
            except AgentError as err:
                error = str(err)
        seen_pod = pod_of(pod, leaving_nodes, agent, error)
        return seen_pod if member == name else replace(seen_pod, name=member, pod=name)

    with ThreadPoolExecutor(max_workers=min(16, max(len(seen), 1))) as pool:
        pods = list(pool.map(lambda pair: look(*pair), seen))
    return Observation({p.name: p for p in pods})
