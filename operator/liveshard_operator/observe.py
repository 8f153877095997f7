"""What the controller sees of a job: its pods, whether each is leaving, and what its agent says.

A pod is *leaving* when it is being deleted, has a `DisruptionTarget` condition, or sits on a
node that is cordoned or tainted `NoExecute`: its state must move out now. A pod is *gone* when
it has ended (a worker never restarts in place: its state is lost with its process). Agents are
asked for their status in parallel, each call bounded, so one slow agent does not stall the rest.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from liveshard.v1 import agent_pb2 as pb

from .agents import AgentClient, AgentError
from .kube import Kube
from .render import JOB_LABEL, ROLE_LABEL


@dataclass(frozen=True)
class Pod:
    name: str
    ip: str | None
    role: str
    leaving: bool
    gone: bool
    created: str
    agent: pb.AgentStatus | None  # None: not answering (yet)
    error: str = ""

    @property
    def ready(self) -> bool:
        return self.agent is not None and self.agent.ready and not self.leaving and not self.gone

    @property
    def standing_by(self) -> bool:
        return self.ready and self.agent is not None and self.agent.phase == pb.AgentStatus.STANDBY


@dataclass(frozen=True)
class Observation:
    pods: dict[str, Pod]

    def live(self) -> list[Pod]:
        """Pods that are neither gone nor leaving, oldest first."""
        return sorted(
            (p for p in self.pods.values() if not p.gone and not p.leaving),
            key=lambda p: (p.created, p.name),
        )


def _node_leaving(node: dict[str, Any]) -> bool:
    spec = node.get("spec") or {}
    taints = spec.get("taints") or []
    return bool(spec.get("unschedulable")) or any(t.get("effect") == "NoExecute" for t in taints)


def _leaving(pod: dict[str, Any], leaving_nodes: set[str]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return True
    conditions = (pod.get("status") or {}).get("conditions") or []
    if any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conditions):
        return True
    return (pod.get("spec") or {}).get("nodeName") in leaving_nodes


def observe(
    kube: Kube, namespace: str, job: str, token: str, port: int, clients: dict[str, AgentClient]
) -> Observation:
    """The job's pods and their agents' status; `clients` caches one client per pod."""
    leaving_nodes = {n["metadata"]["name"] for n in kube.nodes() if _node_leaving(n)}
    raw = kube.pods(namespace, f"{JOB_LABEL}={job}")
    for name in set(clients) - {p["metadata"]["name"] for p in raw}:
        clients.pop(name).close()

    def look(pod: dict[str, Any]) -> Pod:
        meta, status = pod["metadata"], pod.get("status") or {}
        name, ip = meta["name"], status.get("podIP")
        agent, error = None, ""
        gone = status.get("phase") in ("Failed", "Succeeded")
        if ip and not gone:
            client = clients.get(name)
            if client is None:
                client = clients[name] = AgentClient(name, ip, port, token, timeout=3.0)
            try:
                agent = client.status()
            except AgentError as err:
                error = str(err)
        return Pod(
            name=name, ip=ip, role=(meta.get("labels") or {}).get(ROLE_LABEL, ""),
            leaving=_leaving(pod, leaving_nodes), gone=gone,
            created=meta.get("creationTimestamp", ""), agent=agent, error=error,
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=min(16, max(len(raw), 1))) as pool:
        pods = list(pool.map(look, raw))
    return Observation({p.name: p for p in pods})
