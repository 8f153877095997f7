"""Worlds: one epoch of the job, its members, its layout and the process groups between them.

Groups are built directly as process-group objects from a c10d store under a prefix per epoch and
per group, never through `init_process_group` or the global default group, so a new world (and the
union group of old and new members used for a transfer) can be built in a background thread while
the old world trains. gloo serves CPU tensors, NCCL CUDA ones. Such groups are not registered with
torch.distributed: helpers like `batch_isend_irecv` refuse them, so callers use the group's own
`send`, `recv` and `allreduce`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, cast

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
    Work,
)

from .layout.layout import Layout

log = logging.getLogger(__name__)


class Group(Protocol):
    """What the engine uses of a backend (ProcessGroupGloo, ProcessGroupNCCL)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work: ...
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...
    def _start_coalescing(self, device: torch.device) -> None: ...
    def _end_coalescing(self, device: torch.device) -> Work: ...
    def abort(self) -> None: ...


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


def host_store(address: StoreAddress, timeout: float) -> TCPStore:
    """Start the job's store in this process (a surviving member hosts it)."""
    return TCPStore(
        address.host, address.port, None, True, timedelta(seconds=timeout), wait_for_workers=False
    )


def connect_store(address: StoreAddress, timeout: float) -> TCPStore:
    return TCPStore(address.host, address.port, None, False, timedelta(seconds=timeout))


def new_group(
    store: Store, prefix: str, rank: int, size: int, device: torch.device, timeout: float
) -> Group:
    """A process group of `size` members under `prefix`; every member calls this with its rank."""
    prefixed = PrefixStore(prefix, store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return cast(Group, ProcessGroupNCCL(prefixed, rank, size, options))
    return cast(Group, ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout)))


@dataclass
class World:
    """A member's view of one epoch: its rank in the layout and the groups it belongs to."""

    epoch: int
    layout: Layout
    member: str
    device: torch.device
    groups: dict[str, Group] = field(repr=False)

    @property
    def rank(self) -> int:
        return self.layout.members.index(self.member)

    @classmethod
    def build(
        cls,
        store: Store,
        epoch: int,
        layout: Layout,
        member: str,
        device: torch.device,
        timeout: float,
    ) -> World:
        """Create this member's groups of the world: all ranks, and its tp, dp, pp and ep groups.

        Each group has its own store prefix, so members create them in any order and concurrently.
        """
        rank = layout.members.index(member)
        pp_i, dp_i, tp_i = layout.coords(rank)
        ep_i, expert_dp_i = dp_i % layout.ep, dp_i // layout.ep
        axes = {
            "world": ("all", rank, layout.world_size),
            "tp": (f"{pp_i}.{dp_i}", tp_i, layout.tp),
            "dp": (f"{pp_i}.{tp_i}", dp_i, layout.dp),
            "pp": (f"{dp_i}.{tp_i}", pp_i, layout.pp),
            # ep: the ranks of one expert-dp index that together hold every expert.
            "ep": (f"{pp_i}.{tp_i}.{expert_dp_i}", ep_i, layout.ep),
            # expert_dp: the ranks with the same ep rank, across which expert shards are cut.
            "expert_dp": (f"{pp_i}.{tp_i}.{ep_i}", expert_dp_i, layout.dp // layout.ep),
        }
        groups = {
            axis: new_group(store, f"liveshard/{epoch}/{axis}/{key}", r, size, device, timeout)
            for axis, (key, r, size) in axes.items()
        }
        log.debug("epoch %s: member %s built its world groups as rank %s", epoch, member, rank)
        return cls(epoch, layout, member, device, groups)


def union_group(
    store: Store,
    epoch: int,
    members: tuple[str, ...],
    member: str,
    device: torch.device,
    timeout: float,
) -> Group:
    """The group over old and new members that a transfer into epoch `epoch` runs on."""
    rank = members.index(member)
    return new_group(store, f"liveshard/{epoch}/union", rank, len(members), device, timeout)
