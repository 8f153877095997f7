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
from torch.distributed import Work

from liveshard_core.plan.matching import Slot
from liveshard_core.plan.schedule import Schedule

from . import backend
from .backend import Group
from .errors import Cause, TransferError
from .state import ShardedState


@dataclass
class Memory:
    """Bytes a member holds during a switch (old state, shadow state, staging buffers)."""

    budget: int
    old: int = 0
    shadow: int = 0
    staging: int = 0
    peak_staging: int = 0

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        self.staging += _nbytes(tensor)
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
    *,
    slot: Slot,
    old: ShardedState | None,
    shadow: ShardedState | None,
    group: Group,
    deadline: float,
    epoch: int,
    memory: Memory,
    overlap: Callable[[], object] | None = None,
    before_round: Callable[[int], None] | None = None,
) -> TransferStats:
    """Execute `slot`'s rounds and local copies; raise TransferError.

    The local copies, and `overlap` (work that reads the old state), run while the first round's
    operations are in flight. `before_round(r)` is called as round r starts.
    """
    holder = old if old is not None else shadow
    if holder is None:
        raise ValueError(f"epoch {epoch}: slot {slot} has neither an old nor a new state")
    stats = TransferStats()
    pending_local: list[Callable[[], object]] = [
        partial(_copy_local, schedule, slot, old, shadow, stats)
    ]
    if overlap is not None:
        pending_local.append(overlap)
    device = holder.device
    coalesce = backend.coalesces(device)
    for r, ops in enumerate(schedule.slot_rounds(slot)):
        if before_round is not None:
            before_round(r)
        if not ops:
            continue
        works: list[tuple[Work, Slot | None]] = []
        finishes: list[Callable[[], object]] = []
        tags: dict[Slot, int] = defaultdict(int)
        if coalesce:
            backend.start_coalescing(group, device)
        for ref, piece in ops:
            peer = piece.dst if piece.src == slot else piece.src
            tag = tags[peer]
            tags[peer] += 1
            if piece.src == slot:
                assert old is not None
                source = old.view(ref, piece.box)
                buf = source if source.is_contiguous() else memory.stage(source.contiguous())
                works.append((_post(group.send, buf, peer, tag, epoch, schedule), peer))
                stats.sent_bytes += _nbytes(buf)
            else:
                assert shadow is not None
                target = shadow.view(ref, piece.box)
                buf = target
                if not target.is_contiguous():
                    buf = memory.stage(
                        torch.empty_like(target, memory_format=torch.contiguous_format)
                    )
                    finishes.append(partial(target.copy_, buf))
                works.append((_post(group.recv, buf, peer, tag, epoch, schedule), peer))
                stats.received_bytes += _nbytes(buf)
        if coalesce:
            works = [(backend.end_coalescing(group, device), None)]
        while pending_local:
            pending_local.pop(0)()
        for work, waited_peer in works:
            _wait(work, deadline, epoch, schedule, waited_peer)
        for finish in finishes:
            finish()
        memory.staging = 0
        stats.rounds += 1
    for local in pending_local:  # no round had operations of this slot
        local()
    return stats


def _copy_local(
    schedule: Schedule,
    slot: Slot,
    old: ShardedState | None,
    shadow: ShardedState | None,
    stats: TransferStats,
) -> None:
    if old is None or shadow is None:
        return
    for ref, piece in schedule.plan.local_copies(slot):
        target = shadow.view(ref, piece.box)
        target.copy_(old.view(ref, piece.box))
        stats.local_bytes += _nbytes(target)


def _post(
    op: Callable[[list[torch.Tensor], int, int], Work],
    buf: torch.Tensor,
    peer: Slot,
    tag: int,
    epoch: int,
    schedule: Schedule,
) -> Work:
    try:
        return op([buf], peer, tag)
    except RuntimeError as err:  # gloo fails at once when the peer's connection is gone
        who = _who(schedule, peer)
        raise TransferError(
            f"epoch {epoch}: transfer with {who} failed: {err}", Cause.PEER_FAILED
        ) from None


def _who(schedule: Schedule, peer: Slot | None) -> str:
    """A peer by name; None stands for a coalesced round's peers."""
    return "its peers" if peer is None else f"member {schedule.plan.members[peer]}"


def _wait(work: Work, deadline: float, epoch: int, schedule: Schedule, peer: Slot | None) -> None:
    remaining = deadline - time.monotonic()
    who = _who(schedule, peer)
    if remaining <= 0:
        raise TransferError(
            f"epoch {epoch}: switch deadline passed waiting for {who}", Cause.DEADLINE_PASSED
        )
    try:
        work.wait(timedelta(seconds=remaining))
    except RuntimeError as err:
        # A wait that ends at the deadline timed out; one that ends before it, the peer failed.
        cause = Cause.DEADLINE_PASSED if time.monotonic() >= deadline else Cause.PEER_FAILED
        raise TransferError(f"epoch {epoch}: transfer with {who} failed: {err}", cause) from None
