"""Worlds: one epoch of the job, its members, its layout and the process groups between them.

Groups are built directly as process-group objects from a c10d store under a prefix per epoch and
per group (`backend.new_group`), never through `init_process_group` or the default group, so a new
world (and the union group of old and new members used for a transfer) can be built in a
background thread while the old world trains. gloo serves CPU tensors, NCCL CUDA ones. Such groups
are not registered with torch.distributed: callers use the group's own `send`, `recv` and
`allreduce`, never the `torch.distributed.*` functions that look groups up.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

import torch
from torch.distributed import Store, TCPStore

from liveshard_core.layout.layout import Layout

from . import keys
from .backend import Group, new_group

log = logging.getLogger(__name__)


class Axis(Enum):
    """The process groups of a world, one per parallel axis (and the whole world)."""

    WORLD = "world"
    TP = "tp"
    DP = "dp"
    PP = "pp"
    EP = "ep"  # the ranks of one expert-dp index that together hold every expert
    EXPERT_DP = "expert_dp"  # the ranks with the same ep rank, across which expert shards are cut
    EMBED = "embed"  # the first and the last stage's ranks of one (dp, tp): a tied embedding's
    # two copies; only those stages belong to it (one member when pp is 1)


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


@dataclass
class World:
    """A member's view of one epoch: its rank in the layout and the groups it belongs to."""

    epoch: int
    layout: Layout
    member: str
    device: torch.device
    groups: dict[Axis, Group] = field(repr=False)
    closed: str = field(default="", repr=False)  # why it was closed, when a collective failed

    @property
    def rank(self) -> int:
        return self.layout.rank_of(self.member)

    def group(self, axis: Axis) -> Group:
        """The group of `axis`; a RuntimeError, as torch's for a broken collective, once the
        world is closed (`close`): whatever used it next fails as if a peer had."""
        if not self.groups:
            raise RuntimeError(f"the world of epoch {self.epoch} is closed: {self.closed}")
        return self.groups[axis]

    def close(self, why: str = "") -> None:
        """Close the world's groups in the background (`close_in_background`); the world has
        none after (`why`: the failure that closed it). Destroying a group of communicators
        takes a while (NCCL's each tear down on the device), which must not lengthen a switch's
        pause."""
        self.closed = self.closed or why or "this member closed it"
        groups = list(self.groups.values())
        self.groups.clear()
        close_in_background(groups)

    @classmethod
    def build(
        cls,
        store: Store,
        *,
        epoch: int,
        tag: str,
        layout: Layout,
        member: str,
        device: torch.device,
        timeout: float,
    ) -> World:
        """Create this member's groups of the world: all ranks, and its tp, dp, pp and ep groups.

        Each group has its own store prefix, so members create them in any order and concurrently.
        `tag` is the epoch's (`sealed.Seal.tag`): every key of an epoch carries it.
        """
        rank = layout.rank_of(member)
        pp_i, dp_i, tp_i = layout.coords(rank)
        ep_i, expert_dp_i = dp_i % layout.ep, dp_i // layout.ep
        axes = {
            Axis.WORLD: ("all", rank, layout.world_size),
            Axis.TP: (f"{pp_i}.{dp_i}", tp_i, layout.tp),
            Axis.DP: (f"{pp_i}.{tp_i}", dp_i, layout.dp),
            Axis.PP: (f"{dp_i}.{tp_i}", pp_i, layout.pp),
            Axis.EP: (f"{pp_i}.{tp_i}.{expert_dp_i}", ep_i, layout.ep),
            Axis.EXPERT_DP: (f"{pp_i}.{tp_i}.{ep_i}", expert_dp_i, layout.dp // layout.ep),
        }
        if pp_i in (0, layout.pp - 1):
            axes[Axis.EMBED] = (f"{dp_i}.{tp_i}", 0 if pp_i == 0 else 1, min(layout.pp, 2))
        groups = {
            axis: new_group(
                store,
                prefix=keys.group_prefix(epoch, tag, axis.value, key),
                rank=r,
                size=size,
                device=device,
                timeout=timeout,
            )
            for axis, (key, r, size) in axes.items()
        }
        log.debug("epoch %s: member %s built its world groups as rank %s", epoch, member, rank)
        return cls(epoch, layout, member, device, groups)


def union_group(
    store: Store,
    *,
    epoch: int,
    tag: str,
    members: tuple[str, ...],
    member: str,
    device: torch.device,
    timeout: float,
) -> Group:
    """The group over old and new members that a transfer into epoch `epoch` (tagged `tag`)
    runs on."""
    slot = members.index(member)
    return new_group(
        store, prefix=keys.union_prefix(epoch, tag), rank=slot, size=len(members), device=device,
        timeout=timeout,
    )  # fmt: skip


_closing: set[threading.Thread] = set()
_closing_lock = threading.Lock()


def close_in_background(groups: list[Group]) -> None:
    """Close the groups in `groups` in a thread of their own; the list is emptied, so that the
    caller holds no reference and the thread drops the last one.

    Closing a group waits for its connections and worker threads to end: tens of milliseconds on
    a busy host, up to a second for NCCL's, which must not lengthen a switch's pause. The thread
    shuts each group down first, which torch does without the GIL, so the caller's training goes
    on meanwhile; a group merely dropped is torn down in its destructor, under the GIL."""
    taken = list(groups)
    groups.clear()

    def close() -> None:
        for group in taken:
            group.shutdown()
        taken.clear()
        with _closing_lock:
            _closing.discard(threading.current_thread())

    thread = threading.Thread(target=close, name="liveshard-close-groups", daemon=True)
    with _closing_lock:
        _closing.add(thread)
    thread.start()


def wait_closed(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the groups being closed in the background; whether they
    all are."""
    with _closing_lock:
        threads = list(_closing)
    for thread in threads:
        thread.join(timeout)
    return not any(t.is_alive() for t in threads)
