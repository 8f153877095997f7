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

import grpc

from liveshard.v1 import agent_pb2 as pb

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
    (a client made with a pair `tls` no longer gives is made again). A pod of several members is
    asked for all of their statuses in one call."""
    leaving_nodes = {n["metadata"]["name"] for n in kube.nodes() if node_leaving(n)}
    raw = kube.pods(namespace, f"{JOB_LABEL}={job}")
    for name in set(clients) - {member for pod in raw for member in pod_members(pod)}:
        clients.pop(name).close()

    def client(pod: dict[str, Any], member: str, ip: str) -> AgentClient:
        want = tls() if serves_tls(pod) else None
        found = clients.get(member)
        if found is not None and found.tls != want:  # the operator's pair was renewed
            found.close()
            found = None
        if found is None:
            found = clients[member] = AgentClient(member, ip, port, token, timeout=3.0, tls=want)
        return found

    def statuses(pod: dict[str, Any], members: list[str]) -> dict[str, pb.AgentStatus | str]:
        """Each member's status, or why there is none."""
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or gone(pod):
            return {m: "" for m in members}
        calls = [client(pod, m, ip) for m in members]
        if len(calls) == 1:
            return {calls[0].member: _status_or_error(calls[0])}
        try:
            answer = calls[0].pod_status()
        except AgentError as err:
            if err.code is grpc.StatusCode.UNIMPLEMENTED:  # an agent of before the call
                return {c.member: _status_or_error(c) for c in calls}
            return {m: str(err) for m in members}
        found: dict[str, pb.AgentStatus | str] = {s.member: s for s in answer.members}
        missing = {m: f"agent {m}: {answer.unanswered.get(m, 'no status')}" for m in members}
        return {m: found[m] if m in found else missing[m] for m in members}

    def look(pod: dict[str, Any]) -> list[Pod]:
        name, members = pod["metadata"]["name"], pod_members(pod)
        seen = []
        for member, found in statuses(pod, members).items():
            agent, error = (found, "") if isinstance(found, pb.AgentStatus) else (None, found)
            seen_pod = pod_of(pod, leaving_nodes, agent, error)
            seen.append(seen_pod if member == name else replace(seen_pod, name=member, pod=name))
        return seen

    with ThreadPoolExecutor(max_workers=min(16, max(len(raw), 1))) as pool:
        pods = [p for found in pool.map(look, raw) for p in found]
    return Observation({p.name: p for p in pods})


def _status_or_error(client: AgentClient) -> pb.AgentStatus | str:
    try:
        return client.status()
    except AgentError as err:
        return str(err)
