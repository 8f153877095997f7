"""What the pods of one node share: the node's spec, API access, the base environment, and the
pools of pod IPs and GPU indices."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from liveshard_e2e.kubelet.config import KubeletConfig, NodeSpec
from liveshard_e2e.kubelet.env import EnvError
from liveshard_e2e.rest import Rest


@dataclass
class NodeRuntime:
    """What the pods of one node share: its spec, API access, address and GPU pools."""

    config: KubeletConfig
    spec: NodeSpec
    rest: Rest
    base_env: dict[str, str]
    _next_ip: int = 0
    _free_gpus: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._free_gpus = list(range(self.spec.gpus))

    def allocate_ip(self) -> str:
        """A distinct address per pod: on the loopback,
        127.<node index + 1>.<cluster's ip_block + n / 250>.<n % 250 + 1>; in a pod network
        of namespaces, 10.<cluster's ip_block + 1>.<node index>.<n % 250 + 2>."""
        with self._lock:
            n = self._next_ip
            self._next_ip += 1
        if self.config.pod_network == "netns":
            return f"10.{self.config.ip_block + 1}.{self.spec.index}.{n % 250 + 2}"
        third = (self.config.ip_block + n // 250) % 256
        return f"127.{self.spec.index + 1}.{third}.{n % 250 + 1}"

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
