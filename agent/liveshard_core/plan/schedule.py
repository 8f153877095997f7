"""Schedules: a plan's network pieces cut into rounds under a per-member memory budget.

Every member executes the rounds in the same order. Within a round a member posts all its sends
and receives at once (one coalesced group on NCCL) and waits for all of them before the next round.

Why this cannot deadlock: the rounds are computed from data every member has alike (the plan's
inputs, agreed by digest, the budget, and the loads below), so every send in round r has its
matching receive in round r at its peer, posted in the same relative order. A member waits in
round r only for operations that its peers post in round r; by induction on r, every member
reaches round r, posts all of them, and so every operation of round r completes.

How rounds are cut, so that a member can cut them alone. The rounds depend on each class of
tensors only through its *loads* (`Loads`): per tensor, the most any one member sends, receives,
and sends plus receives, the same per row of the pieces it moves, and the most rows of one piece.
Each member computes its own loads from its own part (`view.member_plan`); the elementwise maximum
over the members (one all-reduce of a few integers per class) is the plan's loads, equal to what
the whole plan gives. From the loads alone, the same packing runs everywhere (`_Rounds`):

- a class whose tensors fit a round travels as *segments* of whole tensors; a larger one is cut
  along dim 0 into *chunks*: chunk c of a tensor is rows `[c*R, (c+1)*R)` of every one of its
  pieces, counted from the piece's first row, with R rows chosen so that the busiest member's
  rows fit the budget;
- a round takes a move while one of two upper bounds of every member's bytes stays within the
  budget: the sum over the round's moves of their most sent plus received bytes, or, by *lanes*
  (a pipeline stage, and an expert owner within it, of the old layout for sends and of the new
  layout for receives), the largest sends any lane combination adds up to plus the largest
  receives. The second lets classes of different stages or experts share a round.

Memory: in each round, the bytes a member sends (staged contiguously) plus the bytes it receives
stay within the budget. A budget below one row of every piece one member moves in a class is an
error, not a hang. Local copies need no buffer and are not scheduled.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..errors import InvalidInput
from ..layout.layout import Layout
from ..layout.region import Placed, holder_eps
from ..vps.box import Box, replace_dim, volume
from ..vps.spec import ModelSpec, TensorRef
from .classes import TensorClass
from .matching import Piece, Slot
from .plan import Plan

if TYPE_CHECKING:
    from .view import MemberPlan


@dataclass(frozen=True, slots=True)
class Loads:
    """Per tensor of one pattern, in elements: the most one member sends, receives, and sends
    plus receives; the same per row of its pieces; the most rows of one network piece."""

    send: int = 0
    recv: int = 0
    both: int = 0
    send_row: int = 0
    recv_row: int = 0
    both_row: int = 0
    rows: int = 0

    def __or__(self, other: Loads) -> Loads:
        """The elementwise maximum: the loads of two sets of members together."""
        return Loads(*(max(a, b) for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def of(cls, network: Sequence[Piece], slot: Slot | None = None) -> Loads:
        """The loads of `network` pieces: over every member, or `slot`'s alone."""
        sends: dict[Slot, int] = defaultdict(int)
        recvs: dict[Slot, int] = defaultdict(int)
        send_rows: dict[Slot, int] = defaultdict(int)
        recv_rows: dict[Slot, int] = defaultdict(int)
        rows = 0
        for src, dst, box in network:
            if slot is not None and slot != src and slot != dst:
                continue
            n = volume(box)
            height = box[0][1] - box[0][0]
            rows = max(rows, height)
            if slot is None or slot == src:
                sends[src] += n
                send_rows[src] += n // height
            if slot is None or slot == dst:
                recvs[dst] += n
                recv_rows[dst] += n // height
        members = sends.keys() | recvs.keys()
        return cls(
            max(sends.values(), default=0),
            max(recvs.values(), default=0),
            max((sends.get(m, 0) + recvs.get(m, 0) for m in members), default=0),
            max(send_rows.values(), default=0),
            max(recv_rows.values(), default=0),
            max((send_rows.get(m, 0) + recv_rows.get(m, 0) for m in members), default=0),
            rows,
        )


@dataclass(frozen=True, slots=True)
class Segment:
    """Tensors `first..stop-1` of plan group `group`, every network piece of their pattern."""

    group: int
    first: int
    stop: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """Chunk `index` of tensor `tensor` of plan group `group`: rows `[index*R, (index+1)*R)` of
    each of its network pieces, counted from the piece's first row (R: `Schedule.chunk_rows`)."""

    group: int
    tensor: int
    index: int


Move = Segment | Chunk
"""One entry of a round: a segment of whole tensors or a chunk of one tensor."""

Op = tuple[TensorRef, Piece]


def chunk_box(box: Box, rows: int, index: int) -> Box | None:
    """Chunk `index` of `rows` rows of a piece's box, or None when the piece is shorter."""
    start, stop = box[0]
    first = start + index * rows
    if first >= stop:
        return None
    return replace_dim(box, 0, (first, min(first + rows, stop)))


@dataclass(frozen=True)
class _Rounded:
    budget: int
    rounds: tuple[tuple[Move, ...], ...]
    chunk_rows: dict[int, int]  # rows per chunk of each group cut into chunks

    def expand(
        self, tensors: Callable[[int], TensorClass], mine: Callable[[int], Sequence[Piece]]
    ) -> list[list[Op]]:
        """Round by round, the (tensor, piece) operations of one member, whose network pieces
        of group g's pattern are `mine(g)`."""
        out = []
        for moves in self.rounds:
            ops: list[Op] = []
            for move in moves:
                pieces, cls = mine(move.group), tensors(move.group)
                if isinstance(move, Segment):
                    refs = [cls.tensor(i) for i in range(move.first, move.stop)]
                    ops += [(ref, p) for ref in refs for p in pieces]
                    continue
                ref, rows = cls.tensor(move.tensor), self.chunk_rows[move.group]
                for p in pieces:
                    box = chunk_box(p.box, rows, move.index)
                    if box is not None:
                        ops.append((ref, p._replace(box=box)))
            out.append(ops)
        return out


@dataclass(frozen=True)
class Schedule(_Rounded):
    """The rounds of a whole plan."""

    plan: Plan

    @property
    def spec(self) -> ModelSpec:
        return self.plan.spec

    def slot_rounds(self, slot: Slot) -> list[list[Op]]:
        """The network pieces `slot` sends or receives, round by round, in the order it must
        post them."""
        plan = self.plan

        def mine(g: int) -> list[Piece]:
            pattern = plan.pattern_of(plan.groups[g])
            return [pattern.network[i] for i in pattern.network_by_slot.get(slot, ())]

        return self.expand(lambda g: plan.groups[g].tensors, mine)

    def local_copies(self, slot: Slot) -> list[Op]:
        return self.plan.local_copies(slot)

    def move_bytes(self, move: Move) -> list[tuple[Slot, Slot, int]]:
        """(source, destination, bytes) of every transfer in `move`."""
        group = self.plan.groups[move.group]
        network = self.plan.pattern_of(group).network
        if isinstance(move, Segment):
            count = group.itemsize * (move.stop - move.first)
            return [(p.src, p.dst, volume(p.box) * count) for p in network]
        rows = self.chunk_rows[move.group]
        return [
            (p.src, p.dst, volume(box) * group.itemsize)
            for p in network
            if (box := chunk_box(p.box, rows, move.index)) is not None
        ]

    def round_bytes(self) -> list[dict[Slot, int]]:
        """Buffer bytes (sent plus received) per slot in each round."""
        out = []
        for moves in self.rounds:
            used: dict[Slot, int] = defaultdict(int)
            for move in moves:
                for src, dst, n in self.move_bytes(move):
                    used[src] += n
                    used[dst] += n
            out.append(dict(used))
        return out


@dataclass(frozen=True)
class MemberSchedule(_Rounded):
    """The rounds of one member's part of a plan, cut like the whole plan's (same moves)."""

    part: MemberPlan

    @property
    def spec(self) -> ModelSpec:
        return self.part.spec

    def _own(self, slot: Slot) -> MemberPlan:
        if slot != self.part.slot:
            raise InvalidInput(
                f"a member's schedule holds slot {self.part.slot}'s part, not {slot}'s"
            )
        return self.part

    def slot_rounds(self, slot: Slot) -> list[list[Op]]:
        """The member's operations round by round (`slot` must be its own)."""
        part = self._own(slot)
        return self.expand(lambda g: part.groups[g][1], lambda g: part.network[part.groups[g][0]])

    def local_copies(self, slot: Slot) -> list[Op]:
        local, _, _ = self._own(slot).expanded()
        return local


Position = tuple[int, int]
"""Where a member is: its seat under the old layout and under the new one. A seat is
`stage * ep + ep rank + 1`, or 0 where the member is not a live member of that layout. Members
in one position hold and need the same classes."""


def _seat(layout: Layout, rank: int | None) -> int:
    if rank is None:
        return 0
    pp_i, dp_i, _ = layout.coords(rank)
    return pp_i * layout.ep + dp_i % layout.ep + 1


def member_position(
    old: Layout, new: Layout, old_rank: int | None, new_rank: int | None
) -> Position:
    return _seat(old, old_rank), _seat(new, new_rank)


def _touches(layout: Layout, placed: Placed, seat: int) -> bool:
    """Whether members in `seat` of `layout` hold (or need) the tensors placed `placed`."""
    if not seat:
        return False
    stage, ep_i = divmod(seat - 1, layout.ep)
    return stage in placed.stages and ep_i in holder_eps(layout, placed)


@dataclass(frozen=True)
class Traffic:
    """What cuts a plan's rounds besides its classes: the loads of each pattern, and the positions
    members are in. A member computes its own (`member_traffic`); the plan's is the union over
    the members (`|`, or one all-reduce with MAX of `vector()`)."""

    loads: tuple[Loads, ...]
    positions: frozenset[Position]
    seats: tuple[int, int]  # how many seats each layout has, counting 0

    def __or__(self, other: Traffic) -> Traffic:
        loads = tuple(a | b for a, b in zip(self.loads, other.loads, strict=True))
        return Traffic(loads, self.positions | other.positions, self.seats)

    def vector(self) -> list[int]:
        """The loads, then one 0/1 flag per position: every member's vector has the same
        length."""
        old, new = self.seats
        flags = [0] * (old * new)
        for a, b in self.positions:
            flags[a * new + b] = 1
        return [v for one in self.loads for v in one.values()] + flags

    def from_vector(self, values: Sequence[int]) -> Traffic:
        """The traffic a `vector()` (maximised over members) stands for."""
        width, count = len(fields(Loads)), len(self.loads)
        if len(values) != len(self.vector()):
            raise InvalidInput(f"traffic of {len(values)} values, expected {len(self.vector())}")
        loads = tuple(Loads(*values[i * width : (i + 1) * width]) for i in range(count))
        _, new = self.seats
        flags = values[count * width :]
        positions = frozenset(divmod(i, new) for i, flag in enumerate(flags) if flag)
        return Traffic(loads, positions, self.seats)


def _seats(old: Layout, new: Layout) -> tuple[int, int]:
    return old.pp * old.ep + 1, new.pp * new.ep + 1


class _Rounds:
    """First-fit packing of moves into rounds of `budget` bytes per member (module docstring)."""

    def __init__(self, budget: int, positions: int) -> None:
        self.budget, self.positions = budget, positions
        self.moves: list[list[Move]] = []
        self.used: list[list[int]] = []  # bytes of each position in each round

    def _room(self, r: int, load: Sequence[tuple[int, int]], most: int) -> int:
        """How many copies of `load` ((position, bytes) pairs) still fit into round r, up to
        `most`."""
        if r == len(self.moves):
            self.moves.append([])
            self.used.append([0] * self.positions)
        used = self.used[r]
        return min([most, *((self.budget - used[k]) // n for k, n in load)])

    def _add(self, r: int, move: Move, load: Sequence[tuple[int, int]], copies: int) -> None:
        self.moves[r].append(move)
        used = self.used[r]
        for k, n in load:
            used[k] += n * copies

    def place_tensors(self, group: int, count: int, load: Sequence[tuple[int, int]]) -> None:
        """Place `count` tensors of equal `load`, as few segments as possible."""
        first, r = 0, 0
        while first < count:
            take = self._room(r, load, count - first)
            if take > 0:
                self._add(r, Segment(group, first, first + take), load, take)
                first += take
            r += 1

    def place_chunk(self, chunk: Chunk, load: Sequence[tuple[int, int]], start: int) -> int:
        """Place one chunk in the first round from `start` with room; return that round.

        Usage only grows, so the next chunk of the same tensor cannot fit before this round.
        """
        r = start
        while self._room(r, load, 1) < 1:
            r += 1
        self._add(r, chunk, load, 1)
        return r


def cut_rounds(
    spec: ModelSpec,
    old: Layout,
    new: Layout,
    classes: Sequence[TensorClass],
    loads: Sequence[Loads],
    positions: Sequence[Position],
    budget: int,
) -> tuple[tuple[tuple[Move, ...], ...], dict[int, int]]:
    """The rounds of plan groups `classes` whose patterns' loads are `loads` (one per group),
    among members in `positions`, and the rows per chunk of each group cut into chunks."""
    if budget < 1:
        raise InvalidInput(f"budget must be a positive number of bytes, got {budget}")
    rounds = _Rounds(budget, len(positions))
    chunk_rows: dict[int, int] = {}
    for g, (cls, pattern) in enumerate(zip(classes, loads, strict=True)):
        if not pattern.both:
            continue

        def load(send: int, recv: int, both: int, cls: TensorClass = cls) -> list[tuple[int, int]]:
            """Bytes members of each position may move in the class: they send, receive, or
            both."""
            out = []
            for k, (a, b) in enumerate(positions):
                sends, recvs = _touches(old, cls.old, a), _touches(new, cls.new, b)
                n = both if sends and recvs else send if sends else recv if recvs else 0
                if n:
                    out.append((k, n))
            return out

        size = cls.itemsize
        if pattern.both * size <= budget:
            rounds.place_tensors(
                g, len(cls), load(pattern.send * size, pattern.recv * size, pattern.both * size)
            )
            continue
        row = pattern.both_row * size
        rows = budget // row
        if rows < 1:
            name = spec.tensor_name(cls.tensor(0))
            raise InvalidInput(
                f"budget {budget} bytes is below one row ({row} bytes) of {name}, counted over "
                "every piece of it one member moves; raise the budget"
            )
        chunk_rows[g] = rows
        chunk = load(pattern.send_row * size * rows, pattern.recv_row * size * rows, row * rows)
        for tensor in range(len(cls)):
            start = 0
            for index in range(-(-pattern.rows // rows)):
                start = rounds.place_chunk(Chunk(g, tensor, index), chunk, start)
    return tuple(tuple(moves) for moves in rounds.moves), chunk_rows


def plan_traffic(plan: Plan) -> Traffic:
    """The traffic of a whole plan: every pattern's loads, every member's position."""
    old, new = plan.old, plan.new
    positions = frozenset(
        member_position(
            old, new, old.ranks.get(m) if m not in plan.lost else None, new.ranks.get(m)
        )
        for m in plan.members
    )
    loads = tuple(Loads.of(p.network) for p in plan.patterns)
    return Traffic(loads, positions, _seats(old, new))


def build_schedule(plan: Plan, budget: int) -> Schedule:
    """Cut `plan`'s network pieces into rounds of at most `budget` buffer bytes per member."""
    traffic = plan_traffic(plan)
    rounds, chunk_rows = cut_rounds(
        plan.spec, plan.old, plan.new, [g.tensors for g in plan.groups],
        [traffic.loads[g.pattern] for g in plan.groups], sorted(traffic.positions), budget,
    )  # fmt: skip
    return Schedule(budget, rounds, chunk_rows, plan)


def member_traffic(part: MemberPlan) -> Traffic:
    """The traffic of a member's own part: the plan's is the union over the members."""
    loads = tuple(Loads.of(network, part.slot) for network in part.network)
    return Traffic(loads, frozenset({part.position}), _seats(part.old, part.new))


def member_schedule(part: MemberPlan, traffic: Traffic, budget: int) -> MemberSchedule:
    """The member's rounds, given the plan's traffic (`member_traffic` united over every
    member): the same rounds as `build_schedule`'s, restricted to the member."""
    if len(traffic.loads) != len(part.patterns):
        raise InvalidInput(
            f"traffic of {len(traffic.loads)} patterns given, but the plan has {len(part.patterns)}"
        )
    rounds, chunk_rows = cut_rounds(
        part.spec, part.old, part.new, [cls for _, cls in part.groups],
        [traffic.loads[pattern] for pattern, _ in part.groups], sorted(traffic.positions), budget,
    )  # fmt: skip
    return MemberSchedule(budget, rounds, chunk_rows, part)
