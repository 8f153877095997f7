"""The executor: runs one member's program (`program`) on the union group.

Round by round, the member posts every receive of the round, then every send, without waiting for
the round to end: it waits only when the buffers that earlier rounds still hold leave no room
for the next round's within the budget, and then for its oldest operations first (`program` says
why this cannot deadlock). On NCCL a round's operations are one coalesced group. A message of one
piece goes straight out of the old state and into the shadow where the piece's storage is
contiguous there, otherwise through a staging buffer; a packed message goes through one buffer at
each end. With `Verification.MOVED`, each message is checksummed as it is sent (while it is on
the wire) and as it arrives (while later ones are). Work that reads the old state (`overlap`:
local copies, a whole-state checksum) runs while the first round is in flight.

Where old boxes are read and new boxes written is a `Storage`, which each memory mode's
`SwitchMemory` builds at the switch: the resident mode's old state and preallocated shadow
(`resident.Resident`), or the bounded mode's host copy and shadow filled box by box
(`offload.Bounded`). The executor does not know which mode runs. Any failed or late operation
raises `TransferError` naming the epoch and the peer; the shadow is then garbage, never the old
state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
from torch.distributed import Work

from liveshard_core.layout.layout import Layout
from liveshard_core.vps.box import Box
from liveshard_core.vps.spec import ModelSpec, TensorRef

from . import backend
from .backend import Group
from .checksum import MovedSums
from .errors import Cause, TransferError
from .modes import MemoryMode
from .program import Locator, Message, Program
from .shadow import regions
from .state import ShardedState


@dataclass
class Memory:
    """Bytes a member holds during a switch, against the old state alone (`extra`).

    `shadow` is what the engine allocated for the new state, `kept` the old boxes passed on whole
    (bounded mode), `released` the old state's storage given back (bounded mode), `host` the old
    state's host copy (bounded mode; host memory, not counted as extra)."""

    budget: int
    mode: MemoryMode = MemoryMode.RESIDENT
    old: int = 0
    shadow: int = 0
    kept: int = 0
    released: int = 0
    host: int = 0
    staging: int = 0
    peak_staging: int = 0
    peak_extra: int = 0

    @property
    def extra(self) -> int:
        return self.shadow + self.staging - self.released

    def _note(self) -> None:
        self.peak_staging = max(self.peak_staging, self.staging)
        self.peak_extra = max(self.peak_extra, self.extra)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        self.staging += _nbytes(tensor)
        self._note()
        return tensor

    def unstage(self, nbytes: int) -> None:
        self.staging -= nbytes

    def allocate(self, nbytes: int) -> None:
        self.shadow += nbytes
        self._note()

    def release(self, nbytes: int) -> None:
        self.released += nbytes


@dataclass
class TransferStats:
    local_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    rounds: int = 0  # schedule rounds in which this member sent or received
    messages: int = 0  # sends and receives posted
    stalls: int = 0  # times a round waited for earlier rounds' buffers to make room for it


class Storage(Protocol):
    """Where the executor reads a member's old boxes and writes its new ones, told as rounds
    start (`drain` completes every operation still pending) and end."""

    def source(self, ref: TensorRef, index: int) -> torch.Tensor: ...
    def target(self, ref: TensorRef, index: int) -> torch.Tensor: ...
    def landing(self, round_: int, index: int) -> torch.Tensor | None: ...
    def before_round(self, round_: int, drain: Callable[[], None]) -> None: ...
    def after_round(self, round_: int) -> None: ...  # rounds up to round_ are all complete
    def finish(self) -> None: ...


@dataclass(frozen=True)
class SwitchSide:
    """One member's side of a change, as its memory mode needs it."""

    spec: ModelSpec
    old: Layout
    new: Layout
    old_rank: int | None  # None: not a member of the old layout, or lost with its state
    new_rank: int | None  # None: not a member of the new layout
    device: torch.device
    epoch: int
    member: str


class SwitchMemory(Protocol):
    """A memory mode's part of one switch (`modes.MemoryMode`): what it allocates in prepare,
    the `Storage` it gives the executor at the switch, and the state that comes out of it.
    `resident.ResidentMemory` and `offload.BoundedMemory` are the two."""

    # Whether sends must go through buffers: the old storage may be given back under them.
    sends_need_buffers: bool

    @property
    def shadow(self) -> ShardedState | None:
        """The new state allocated in prepare, if the mode allocates it then."""

    def prepare(self, program: Program, new_boxes: dict[TensorRef, list[Box]]) -> None:
        """Allocate, and touch, the memory the pause writes into (so it pays no page faults)."""

    def release(self) -> None:
        """Drop what prepare allocated: the reconfiguration ends without its switch."""

    def storage(
        self,
        old: ShardedState | None,
        memory: Memory,
        seconds: dict[str, float],
        read_old: Callable[[], None] | None,
    ) -> tuple[Storage, Callable[[], object] | None]:
        """The switch's storage, and the work to run while the first round is in flight.
        `memory` is told what prepare allocated; `read_old` reads the whole old state, and runs
        while the old state is still whole; `seconds` gets the mode's own timings."""

    def new_state(self) -> ShardedState | None:
        """The new state once the transfer succeeded (None: the member leaves)."""

    def abort(self, seconds: dict[str, float]) -> None:
        """Drop the shadow and leave the old state as it was before the switch."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def view(tensor: torch.Tensor, at: Locator) -> torch.Tensor:
    """The part of a box's tensor that `at` locates (the cheapest view that does)."""
    if at.whole:
        return tensor
    if at.rows is not None:
        return tensor.narrow(0, *at.rows)
    return tensor[at.slices]


@dataclass
class _Pending:
    """A posted operation, until it completes."""

    round: int
    index: int
    message: Message
    work: Work
    buffer: torch.Tensor
    held: int  # buffer bytes it holds
    finish: Callable[[], None] | None  # unpacking or copying in, once it has arrived


def run_program(
    program: Program,
    *,
    storage: Storage,
    group: Group,
    device: torch.device,
    members: tuple[str, ...],
    deadline: float,
    epoch: int,
    memory: Memory,
    sums: MovedSums | None = None,
    overlap: Callable[[], object] | None = None,
    before_round: Callable[[int], None] | None = None,
) -> TransferStats:
    """Execute `program`; raise TransferError. `overlap` runs while the first round is in flight
    (or at once if there is none); `before_round(r)` is called as round r starts."""
    stats = TransferStats(rounds=program.active_rounds)
    coalesce = backend.coalesces(device)
    pending: deque[_Pending] = deque()
    open_ops = [0] * len(program.rounds)  # operations of each round not yet complete
    posted_rounds = 0  # rounds posted so far (or passed over: nothing of this member's)
    done = -1  # every round up to this one is complete

    def advance() -> None:
        nonlocal done
        moved = False
        while done + 1 < posted_rounds and open_ops[done + 1] == 0:
            done += 1
            moved = True
        if moved:
            storage.after_round(done)

    def complete(op: _Pending) -> None:
        _wait(op.work, deadline, epoch, None if coalesce else op.message.peer, members)
        if not op.message.send:
            if sums is not None:
                sums.add(op.round, op.index, op.buffer)
            if op.finish is not None:
                op.finish()
        memory.unstage(op.held)
        open_ops[op.round] -= 1
        advance()

    def drain() -> None:
        while pending:
            complete(pending.popleft())

    for r, round_ in enumerate(program.rounds):
        if before_round is not None:
            before_round(r)
        if not round_.messages:
            posted_rounds = r + 1
            advance()
            continue
        if pending and memory.staging + round_.buffer_bytes > memory.budget:
            stats.stalls += 1
            while pending and memory.staging + round_.buffer_bytes > memory.budget:
                complete(pending.popleft())
        storage.before_round(r, drain)
        if coalesce:
            backend.start_coalescing(group, device)
        posted = []
        for i, message in enumerate(round_.messages):
            staged = memory.staging
            if message.send:
                buf = _send_buffer(message, storage, device, memory)
                work = _post(group.send, buf, message, epoch, members)
                finish = None
                stats.sent_bytes += message.nbytes
            else:
                buf, finish = _receive_buffer(r, i, message, storage, device, memory)
                work = _post(group.recv, buf, message, epoch, members)
                stats.received_bytes += message.nbytes
            posted.append(_Pending(r, i, message, work, buf, memory.staging - staged, finish))
        if coalesce:
            one = backend.end_coalescing(group, device)
            for op in posted:
                op.work = one
        open_ops[r] = len(posted)
        posted_rounds = r + 1
        stats.messages += len(posted)
        pending.extend(posted)
        if overlap is not None:
            overlap()
            overlap = None
        if sums is not None:  # the sent bytes, read while they are on the wire
            for op in posted:
                if op.message.send:
                    sums.add(r, op.index, op.buffer)
    drain()
    if overlap is not None:
        overlap()
    storage.finish()
    return stats


def _send_buffer(
    message: Message, storage: Storage, device: torch.device, memory: Memory
) -> torch.Tensor:
    """The bytes of a send: the piece itself where it can go straight out, else a buffer."""
    if message.packed:
        buf = memory.stage(torch.empty(message.nbytes, dtype=torch.uint8, device=device))
        sources = [view(storage.source(p.ref, p.at.index), p.at) for p in message.parts]
        backend.copy_all(regions(buf, message, [s.dtype for s in sources]), sources)
        return buf
    p = message.parts[0]
    source = view(storage.source(p.ref, p.at.index), p.at)
    if source.is_contiguous() and source.device == device:
        return source
    staged = memory.stage(torch.empty(source.shape, dtype=source.dtype, device=device))
    return staged.copy_(source)


def _receive_buffer(
    round_: int,
    index: int,
    message: Message,
    storage: Storage,
    device: torch.device,
    memory: Memory,
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Where a receive lands, and what to do once it has (None: it landed in place)."""
    landing = storage.landing(round_, index)
    if landing is not None:
        return landing, None
    if message.packed:
        buf = memory.stage(torch.empty(message.nbytes, dtype=torch.uint8, device=device))
        targets = [view(storage.target(p.ref, p.at.index), p.at) for p in message.parts]

        def unpack() -> None:
            backend.copy_all(targets, regions(buf, message, [t.dtype for t in targets]))

        return buf, unpack
    p = message.parts[0]
    target = view(storage.target(p.ref, p.at.index), p.at)
    if target.is_contiguous():
        return target, None
    staged = memory.stage(torch.empty(target.shape, dtype=target.dtype, device=device))

    def copy_in() -> None:
        target.copy_(staged)

    return staged, copy_in


def _who(members: tuple[str, ...], peer: int | None) -> str:
    """A peer by name; None stands for a coalesced round's peers."""
    return "its peers" if peer is None else f"member {members[peer]}"


def _post(
    op: Callable[[list[torch.Tensor], int, int], Work],
    buf: torch.Tensor,
    message: Message,
    epoch: int,
    members: tuple[str, ...],
) -> Work:
    try:
        return op([buf], message.peer, message.tag)
    except RuntimeError as err:  # gloo fails at once when the peer's connection is gone
        raise TransferError(
            f"epoch {epoch}: transfer with {_who(members, message.peer)} failed: {err}",
            Cause.PEER_FAILED,
        ) from None


def _wait(
    work: Work, deadline: float, epoch: int, peer: int | None, members: tuple[str, ...]
) -> None:
    remaining = deadline - time.monotonic()
    who = _who(members, peer)
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
