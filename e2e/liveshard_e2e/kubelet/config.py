"""The process kubelet's configuration (written by the cluster, read by the kubelet process) and
the files through which a running kubelet is steered (a node's heartbeat switch)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeSpec:
    """One fake node and its capacity."""

    name: str
    index: int
    cpu: str = "8"
    memory: str = "32Gi"
    pods: int = 110
    gpus: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.index < 250:
            raise ValueError(f"node {self.name!r}: index {self.index} must be in [0, 250)")
        if self.gpus < 0:
            raise ValueError(f"node {self.name!r}: gpus {self.gpus} must be >= 0")

    def capacity(self) -> dict[str, str]:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods)}
        cap["ephemeral-storage"] = "100Gi"
        if self.gpus:
            cap["nvidia.com/gpu"] = str(self.gpus)
        return cap


@dataclass(frozen=True)
class KubeletConfig:
    """Everything the kubelet process needs; stored as ``<run>/kubelet/config.json``."""

    run_dir: str
    kubeconfig: str
    apiserver_port: int
    ca_file: str
    log_port: int
    log_cert: str
    log_key: str
    nodes: tuple[NodeSpec, ...]
    # Third octet where this cluster's pod IPs start, so clusters side by side rarely overlap.
    ip_block: int = 0
    # "loopback": pods share the host's network, each at a loopback address of its own;
    # "netns": each pod has a network namespace, and NetworkPolicies are enforced (netns.py).
    pod_network: str = "loopback"

    def api_env(self, host: str) -> dict[str, str]:
        """The variables that tell a pod where the API server is, at `host` (127.0.0.1 on the
        host's network; a pod's own loopback is not the host's)."""
        return {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": str(self.apiserver_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.apiserver_port),
            "KUBERNETES_PORT": f"tcp://{host}:{self.apiserver_port}",
        }

    @property
    def state_dir(self) -> Path:
        return Path(self.run_dir) / "kubelet"

    def save(self) -> Path:
        path = self.state_dir / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> KubeletConfig:
        data = json.loads(path.read_text())
        data["nodes"] = tuple(NodeSpec(**n) for n in data["nodes"])
        return cls(**data)


def heartbeat_switch(run_dir: Path | str, node: str) -> Path:
    """While this file exists, the kubelet stops renewing ``node``'s lease and status."""
    return Path(run_dir) / "kubelet" / f"no-heartbeat.{node}"


def set_heartbeat(run_dir: Path | str, node: str, enabled: bool) -> None:
    """Stops (``enabled=False``) or resumes a node's heartbeats, to test node failure."""
    switch = heartbeat_switch(run_dir, node)
    if enabled:
        switch.unlink(missing_ok=True)
    else:
        switch.parent.mkdir(parents=True, exist_ok=True)
        switch.touch()


def pod_dir(run_dir: Path | str, namespace: str, name: str, uid: str) -> Path:
    """Where a pod's logs, token and kubeconfig live."""
    return Path(run_dir) / "kubelet" / "pods" / f"{namespace}_{name}_{uid}"


def pod_tmp(uid: str) -> Path:
    """A pod's containers' TMPDIR: the pod's own, gone with it, as a container's /tmp is (its
    writable layer, or the emptyDir there). Short, under the system's: members' sockets go in
    it, and a socket's path has at most 107 bytes."""
    return Path(tempfile.gettempdir()) / f"liveshard-pod-{uid}"
