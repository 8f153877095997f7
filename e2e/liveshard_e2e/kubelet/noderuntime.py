"""What the pods of one node share: the node's spec, API access, the base environment, and the
pools of pod IPs and GPU indices."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from liveshard_e2e.kubelet.config import KubeletConfig, NodeSpec
from liveshard_e2e.kubelet.env import EnvError
from liveshard_e2e.kubelet.netns import NetworkError
from liveshard_e2e.rest import Rest

HOSTS = 253  # a node's pod addresses in a pod network of namespaces: .2 to .254


@dataclass
class NodeRuntime:
    """What the pods of one node share: its spec, API access, address and GPU pools."""

    config: KubeletConfig
    spec: NodeSpec
    rest: Rest
    base_env: dict[str, str]
    _next_ip: int = 0
    _taken: set[str] = field(default_factory=set)  # the pod network's addresses in use
    _free_gpus: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._free_gpus = list(range(self.spec.gpus))

    def allocate_ip(self) -> str:
        """A distinct address per pod: on the loopback,
        127.<node index + 1>.<cluster's ip_block + n / 250>.<n % 250 + 1>; in a pod network
        of namespaces, the next free 10.<cluster's ip_block + 1>.<node index>.<2 to 254>,
        taken until :meth:`release_ip` (:class:`NetworkError` when all are)."""
        with self._lock:
            if self.config.pod_network == "netns":
                return self._take()
            n = self._next_ip
            self._next_ip += 1
        third = (self.config.ip_block + n // 250) % 256
        return f"127.{self.spec.index + 1}.{third}.{n % 250 + 1}"

    def _take(self) -> str:
        """The first free address from the one after the last taken (the lock held)."""
        prefix = f"10.{self.config.ip_block + 1}.{self.spec.index}."
        for i in range(self._next_ip, self._next_ip + HOSTS):
            ip = f"{prefix}{i % HOSTS + 2}"
            if ip not in self._taken:
                self._next_ip = i + 1
                self._taken.add(ip)
                return ip
        raise NetworkError(f"node {self.spec.name}: all {HOSTS} pod addresses {prefix}* taken")

    def release_ip(self, ip: str) -> None:
        with self._lock:
            self._taken.discard(ip)

    def take_gpus(self, count: int) -> list[int]:
        with self._lock:
            if count > len(self._free_gpus):
                raise EnvError(f"{count} nvidia.com/gpu wanted, {len(self._free_gpus)} free")
            taken, self._free_gpus = self._free_gpus[:count], self._free_gpus[count:]
            return taken

    def return_gpus(self, ids: list[int]) -> None:
        with self._lock:
            self._free_gpus = sorted({*self._free_gpus, *ids})


def gpu_request(container: Mapping[str, Any]) -> int:
    """The container's ``nvidia.com/gpu`` limit (or request)."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get("nvidia.com/gpu") or (
        resources.get("requests") or {}
    ).get("nvidia.com/gpu")
    return int(value or 0)
