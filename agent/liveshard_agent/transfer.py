"""The executor: runs one member's part of a schedule on the union group, into shadow buffers.

Local copies go first, without the network. Then, round by round, the member posts every send and
receive of the round at once and waits for all of them (on NCCL as one coalesced group) before the
next round. A piece whose storage is contiguous is sent from, or received into, the state itself;
any other goes through a staging buffer, counted in `Memory`. The schedule keeps a member's bytes
per round within the budget, so staging never exceeds it. Any failed or late operation raises
`TransferError` naming the epoch and the peer; the shadow state is then garbage, never the old one.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
from torch._C._distributed_c10d import Work

from .plan.schedule import Schedule
from .state import ShardedState
from .world import Group


class TransferError(RuntimeError):
    """A transfer operation failed or missed the deadline."""


@dataclass
class Memory:
    """Bytes a member holds during a switch (old state, shadow state, staging buffers)."""

    budget: int
    old: int = 0
    shadow: int = 0
    staging: int = 0
    peak_staging: int = 0

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        self.staging += tensor.numel() * tensor.element_size()
        self.peak_staging = max(self.peak_staging, self.staging)
        return tensor


@dataclass
class TransferStats:
    local_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    rounds: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def run_schedule(
    schedule: Schedule,
    me: int,
    old: ShardedState | None,
    shadow: ShardedState | None,
    group: Group,
    deadline: float,
    epoch: int,
    memory: Memory,
    overlap: Callable[[], object] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> TransferStats:
    """Execute member `me`'s (a union index) rounds and local copies; raise TransferError.

    The local copies, and `overlap` (work that reads the old state), run while the first round's
    operations are in flight.
    """
    stats = TransferStats()
    pending_local: list[Callable[[], object]] = [
        lambda: _copy_local(schedule, me, old, shadow, stats)
    ]
    if overlap is not None:
        pending_local.append(overlap)
    holder = old if old is not None else shadow
    assert holder is not None, "every union member has an old or a new state"
    device = holder.device
    coalesce = device.type == "cuda"
    for r, ops in enumerate(schedule.member_rounds(me)):
        if on_round is not None:
            on_round(r)
        if not ops:
            continue
        works: list[tuple[object, int | None]] = []
        finishes: list[Callable[[], object]] = []
        tags: dict[int, int] = defaultdict(int)
        if coalesce:
            group._start_coalescing(device)
        for ref, t in ops:
            peer: int = t.dst if t.src == me else t.src
            tag = tags[peer]
            tags[peer] += 1
            if t.src == me:
                assert old is not None
                source = old.view(ref, t.box)
                buf = source if source.is_contiguous() else memory.stage(source.contiguous())
                works.append((_post(group.send, buf, peer, tag, epoch, schedule), peer))
                stats.sent_bytes += _nbytes(buf)
            else:
                assert shadow is not None
                target = shadow.view(ref, t.box)
                buf = target
                if not target.is_contiguous():
                    buf = memory.stage(
                        torch.empty(target.shape, dtype=target.dtype, device=target.device)
                    )
                    finishes.append(partial(target.copy_, buf))
                works.append((_post(group.recv, buf, peer, tag, epoch, schedule), peer))
                stats.received_bytes += _nbytes(buf)
        if coalesce:
            works = [(group._end_coalescing(device), None)]
        while pending_local:
            pending_local.pop(0)()
        for work, waited_peer in works:
            _wait(work, deadline, epoch, schedule, waited_peer)
        for finish in finishes:
            finish()
        memory.staging = 0
        stats.rounds += 1
    for work in pending_local:  # no round had operations of this member
        work()
    return stats


def _copy_local(
    schedule: Schedule,
    me: int,
    old: ShardedState | None,
    shadow: ShardedState | None,
    stats: TransferStats,
) -> None:
    if old is None or shadow is None:
        return
    for ref, t in schedule.plan.local_copies(me):
        target = shadow.view(ref, t.box)
        target.copy_(old.view(ref, t.box))
        stats.local_bytes += _nbytes(target)


def _post(
    op: Callable[[list[torch.Tensor], int, int], Work],
    buf: torch.Tensor,
    peer: int,
    tag: int,
    epoch: int,
    schedule: Schedule,
) -> Work:
    try:
        return op([buf], peer, tag)
    except RuntimeError as err:  # gloo fails at once when the peer's connection is gone
        who = _who(schedule, peer)
        raise TransferError(f"epoch {epoch}: transfer with {who} failed: {err}") from None


def _who(schedule: Schedule, peer: int | None) -> str:
    """A peer (a union index) by name; None stands for a coalesced round's peers."""
    return "its peers" if peer is None else f"member {schedule.plan.members[peer]}"


def _wait(work: object, deadline: float, epoch: int, schedule: Schedule, peer: int | None) -> None:
    remaining = deadline - time.monotonic()
    who = _who(schedule, peer)
    if remaining <= 0:
        raise TransferError(f"epoch {epoch}: switch deadline passed waiting for {who}")
    try:
        work.wait(timedelta(seconds=remaining))  # type: ignore[attr-defined]
    except RuntimeError as err:
        raise TransferError(f"epoch {epoch}: transfer with {who} failed: {err}") from None
