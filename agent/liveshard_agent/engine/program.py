"""What one member posts in a switch: the schedule's rounds as messages, laid out in prepare.

Pure (no torch): computed once in prepare from the schedule and the member's own regions, so the
pause runs no planning code.

A *message* is one send (or its matching receive) between two members. In each round, the pieces
smaller than `PACK_BELOW` bytes that go from one member to another travel together, packed in one
buffer (largest element size first, so every piece stays aligned); every larger piece travels
alone, straight out of the old state and into the shadow wherever its storage is contiguous there.
Both ends derive the same messages from the schedule and number them per direction of each pair
(the message's tag), so what one end sends the other receives in the same order.

A round's *buffer bytes* are what its messages need at this member: packed buffers and staging
for pieces not contiguous here (a piece received into the shadow in place needs none). They are
within the budget, since the schedule keeps a member's bytes per round within it. The executor
posts a round as soon as the buffers still held by earlier rounds leave room for it, without
waiting for the earlier rounds to end; this cannot deadlock. A member posts its rounds in order
and, before posting round r, waits only for operations of rounds before r. By induction on r:
every operation of the rounds before r completes, so every member posts all of round r, so every
operation of round r finds its match and completes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from liveshard_core.plan.matching import Slot
from liveshard_core.plan.schedule import MemberSchedule, Schedule
from liveshard_core.vps.box import Box, box_shape, volume
from liveshard_core.vps.spec import TensorRef

PACK_BELOW = 64 << 10
"""Pieces smaller than this travel packed with the others of their round and pair: below it, a
message of its own costs more (posting, waking, waiting; tens of microseconds) than copying it."""


@dataclass(frozen=True, slots=True)
class Locator:
    """Where a piece lies in a member's state: its box `index` among the member's boxes of the
    tensor, and the `slices` of that box; whether that part of the box is contiguous, whether it
    is the whole box, and `rows` (start, count) when it cuts dim 0 alone (a cheaper view)."""

    index: int
    slices: tuple[slice, ...]
    contiguous: bool
    whole: bool
    rows: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Part:
    """One piece in a message: `offset` is its byte offset in a packed message (0 if alone)."""

    ref: TensorRef
    box: Box
    at: Locator  # in the old state when sending, in the shadow when receiving
    itemsize: int
    offset: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return volume(self.box) * self.itemsize


@dataclass(frozen=True, slots=True)
class Message:
    """One send (`send`) to, or one receive from, `peer`; `tag` numbers it among the messages
    of its direction of the pair."""

    peer: Slot
    send: bool
    tag: int
    parts: tuple[Part, ...]
    packed: bool  # several pieces in one buffer
    nbytes: int

    @property
    def staged(self) -> bool:
        """A single piece whose storage at this end is not contiguous: it goes through a staging
        buffer. (A single piece's bytes on the wire are the same either way, so each end decides
        this alone.)"""
        return not self.packed and not self.parts[0].at.contiguous

    @property
    def lands_in_place(self) -> bool:
        """A packed receive whose pieces are all whole boxes here: it lands in one block of
        memory that those boxes then live in (see `shadow`)."""
        return self.packed and not self.send and all(p.at.whole for p in self.parts)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of buffer this end needs for the message (0: straight from or into the state)."""
        if self.lands_in_place:
            return 0
        return self.nbytes if self.packed or self.staged else 0


@dataclass(frozen=True, slots=True)
class Round:
    """A round's messages at this member, receives first (so that every buffer is ready before
    the peers' sends arrive), and the buffer bytes they need here."""

    messages: tuple[Message, ...]
    buffer_bytes: int


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """A piece the member already holds: copied from its old box into its new one, or, when
    `whole` (the same box under both layouts), passed on as the very same tensor."""

    ref: TensorRef
    box: Box
    source: Locator
    target: Locator
    whole: bool
    nbytes: int


@dataclass(frozen=True, slots=True)
class OldBox:
    """One of the member's old boxes: the last round that reads it (`len(rounds)`: a local copy
    after the last round; None: never read), and whether it is passed on whole to the new
    state."""

    ref: TensorRef
    index: int
    last_round: int | None
    kept: bool


@dataclass(frozen=True, slots=True)
class NewBox:
    """One of the member's new boxes: the first round that receives into it (None: it only gets
    local copies), and whether it is the old box passed on whole."""

    ref: TensorRef
    index: int
    first_round: int | None
    kept: bool


@dataclass(frozen=True)
class Program:
    """Everything `slot` does in a switch, in order."""

    slot: Slot
    rounds: tuple[Round, ...]  # every round of the schedule (empty where this member idles)
    local: tuple[LocalCopy, ...]
    old_boxes: tuple[OldBox, ...]
    new_boxes: tuple[NewBox, ...]

    @property
    def sent_bytes(self) -> int:
        return sum(m.nbytes for r in self.rounds for m in r.messages if m.send)

    @property
    def received_bytes(self) -> int:
        return sum(m.nbytes for r in self.rounds for m in r.messages if not m.send)

    @property
    def active_rounds(self) -> int:
        """Rounds in which this member sends or receives something."""
        return sum(1 for r in self.rounds if r.messages)


def locate(boxes: Sequence[Box], piece: Box) -> Locator:
    """The box among `boxes` that holds `piece`, and the slices of it that do."""
    for index, box in enumerate(boxes):
        if all(b0 <= p0 and p1 <= b1 for (b0, b1), (p0, p1) in zip(box, piece, strict=True)):
            slices = tuple(
                slice(p0 - b0, p1 - b0) for (b0, _), (p0, p1) in zip(box, piece, strict=True)
            )
            whole = box == piece
            rows = None
            if not whole and box[1:] == piece[1:]:
                rows = (piece[0][0] - box[0][0], piece[0][1] - piece[0][0])
            return Locator(index, slices, _contiguous(box, piece), whole, rows)
    raise KeyError(f"no box of {list(boxes)} holds {piece}")


def _contiguous(box: Box, piece: Box) -> bool:
    """Whether `piece` is one contiguous run of `box`'s row-major storage: every dim before the
    last one it cuts is a single index (every dim after it is whole by definition)."""
    cuts = [d for d, (b, p) in enumerate(zip(box, piece, strict=True)) if b != p]
    if not cuts:
        return True
    return all(piece[d][1] - piece[d][0] == 1 for d in range(cuts[-1]))


def build_program(
    schedule: Schedule | MemberSchedule,
    slot: Slot,
    *,
    old_boxes: Mapping[TensorRef, Sequence[Box]],
    new_boxes: Mapping[TensorRef, Sequence[Box]],
    sends_need_buffers: bool = False,
) -> Program:
    """`slot`'s program. `old_boxes` and `new_boxes` are its own regions (empty when it is not in
    that layout). `sends_need_buffers` counts every send as buffer bytes (the bounded mode: a
    send whose old storage was given back goes out of the host copy, through a device buffer)."""
    spec = schedule.spec
    counters: dict[tuple[Slot, Slot], int] = defaultdict(int)

    def message(peer: Slot, send: bool, pieces: list[tuple[TensorRef, Box]]) -> Message:
        direction = (slot, peer) if send else (peer, slot)
        tag = counters[direction]
        counters[direction] += 1
        held = old_boxes if send else new_boxes
        parts, offset = [], 0
        # Largest element size first: every piece of a packed buffer then starts aligned.
        for ref, box in sorted(pieces, key=lambda p: -spec.dtype(p[0].kind).itemsize):
            itemsize = spec.dtype(ref.kind).itemsize
            shape = box_shape(box)
            parts.append(Part(ref, box, locate(held[ref], box), itemsize, offset, shape))
            offset += volume(box) * itemsize
        return Message(peer, send, tag, tuple(parts), len(parts) > 1, offset)

    by_round: list[list[Message]] = []
    for ops in schedule.slot_rounds(slot):
        small: dict[tuple[Slot, bool], list[tuple[TensorRef, Box]]] = defaultdict(list)
        alone: list[tuple[Slot, bool, TensorRef, Box]] = []
        for ref, piece in ops:
            send = piece.src == slot
            peer = piece.dst if send else piece.src
            if volume(piece.box) * spec.dtype(ref.kind).itemsize < PACK_BELOW:
                small[(peer, send)].append((ref, piece.box))
            else:
                alone.append((peer, send, ref, piece.box))
        # Per direction of a pair, both ends list the packed message first, then the lone pieces
        # in the schedule's order, so their tags agree.
        messages = [message(peer, send, pieces) for (peer, send), pieces in small.items()]
        messages += [message(peer, send, [(ref, box)]) for peer, send, ref, box in alone]
        by_round.append(messages)
    rounds = tuple(
        Round(_ordered(messages), _buffer_bytes(messages, sends_need_buffers))
        for messages in by_round
    )
    local = _local_copies(schedule, slot, old_boxes, new_boxes)
    new_uses = _new_uses(rounds, local, new_boxes)
    return Program(slot, rounds, local, _old_uses(rounds, local, old_boxes, new_uses), new_uses)


def _buffer_bytes(messages: Sequence[Message], sends_need_buffers: bool) -> int:
    return sum(m.nbytes if sends_need_buffers and m.send else m.buffer_bytes for m in messages)


def _ordered(messages: list[Message]) -> tuple[Message, ...]:
    return tuple([m for m in messages if not m.send] + [m for m in messages if m.send])


def _local_copies(
    schedule: Schedule | MemberSchedule,
    slot: Slot,
    old_boxes: Mapping[TensorRef, Sequence[Box]],
    new_boxes: Mapping[TensorRef, Sequence[Box]],
) -> tuple[LocalCopy, ...]:
    spec = schedule.spec
    out = []
    for ref, piece in schedule.local_copies(slot):
        source = locate(old_boxes[ref], piece.box)
        target = locate(new_boxes[ref], piece.box)
        whole = (
            old_boxes[ref][source.index] == piece.box and new_boxes[ref][target.index] == piece.box
        )
        nbytes = volume(piece.box) * spec.dtype(ref.kind).itemsize
        out.append(LocalCopy(ref, piece.box, source, target, whole, nbytes))
    return tuple(out)


def _new_uses(
    rounds: tuple[Round, ...],
    local: tuple[LocalCopy, ...],
    new_boxes: Mapping[TensorRef, Sequence[Box]],
) -> tuple[NewBox, ...]:
    first: dict[tuple[TensorRef, int], int] = {}
    for r, round_ in enumerate(rounds):
        for m in round_.messages:
            if not m.send:
                for p in m.parts:
                    first.setdefault((p.ref, p.at.index), r)
    kept = {(c.ref, c.target.index) for c in local if c.whole}
    return tuple(
        NewBox(ref, i, first.get((ref, i)), (ref, i) in kept)
        for ref, boxes in new_boxes.items()
        for i in range(len(boxes))
    )


def _old_uses(
    rounds: tuple[Round, ...],
    local: tuple[LocalCopy, ...],
    old_boxes: Mapping[TensorRef, Sequence[Box]],
    new_uses: tuple[NewBox, ...],
) -> tuple[OldBox, ...]:
    last: dict[tuple[TensorRef, int], int] = {}
    for r, round_ in enumerate(rounds):
        for m in round_.messages:
            if m.send:
                for p in m.parts:
                    last[(p.ref, p.at.index)] = r
    first_receive = {(nb.ref, nb.index): nb.first_round for nb in new_uses}
    kept = set()
    for c in local:
        if c.whole:
            kept.add((c.ref, c.source.index))
            continue
        # A local copy is made when its new box is first needed: at its first receive, or after
        # the last round (`len(rounds)`) for a box that receives nothing.
        when = first_receive[(c.ref, c.target.index)]
        use = len(rounds) if when is None else when
        key = (c.ref, c.source.index)
        last[key] = max(last.get(key, use), use)
    return tuple(
        OldBox(ref, i, last.get((ref, i)), (ref, i) in kept)
        for ref, boxes in old_boxes.items()
        for i in range(len(boxes))
    )
