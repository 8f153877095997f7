"""Schedules: a plan's network pieces cut into rounds under a per-member memory budget.

Every member executes the rounds in the same order. Within a round a member posts all its sends
and receives at once (one coalesced group on NCCL) and waits for all of them before the next round.

Why this cannot deadlock: the rounds are computed from global data only (the plan, which every
member computes identically and checks by digest, and the budget), so every send in round r has
its matching receive in round r at its peer, posted in the same relative order. A member waits in
round r only for operations that its peers post in round r; by induction on r, every member
reaches round r, posts all of them, and so every operation of round r completes.

Memory: in each round, the bytes a member sends (staged contiguously) plus the bytes it receives
stay within the budget. Pieces larger than that are cut along dim 0 into chunks; a single row
larger than the budget is an error, not a hang. Local copies need no buffer and are not scheduled.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..errors import InvalidInput
from ..vps.box import Box, split_rows, volume
from ..vps.spec import TensorRef
from .matching import Piece, Slot
from .plan import Plan


@dataclass(frozen=True, slots=True)
class Segment:
    """Tensors `first..stop-1` of plan group `group`, every network piece of their pattern."""

    group: int
    first: int
    stop: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows `box` of network piece `piece` (an index into the pattern's `network`) of tensor
    `tensor` of plan group `group`: a piece too large to move in one round."""

    group: int
    tensor: int
    piece: int
    box: Box


Move = Segment | Chunk
"""One entry of a round: a segment of whole tensors or a chunk of one piece."""


@dataclass(frozen=True)
class Schedule:
    plan: Plan
    budget: int
    rounds: tuple[tuple[Move, ...], ...]

    def slot_rounds(self, slot: Slot) -> list[list[tuple[TensorRef, Piece]]]:
        """The network pieces `slot` sends or receives, round by round, in the order it must
        post them."""
        out = []
        for moves in self.rounds:
            ops: list[tuple[TensorRef, Piece]] = []
            for move in moves:
                group = self.plan.groups[move.group]
                pattern = self.plan.pattern_of(group)
                if isinstance(move, Segment):
                    mine = [pattern.network[i] for i in pattern.network_by_slot.get(slot, ())]
                    refs = [group.tensors.tensor(i) for i in range(move.first, move.stop)]
                    ops += [(ref, p) for ref in refs for p in mine]
                else:
                    p = pattern.network[move.piece]
                    if slot in (p.src, p.dst):
                        ops.append((group.tensors.tensor(move.tensor), p._replace(box=move.box)))
            out.append(ops)
        return out

    def move_bytes(self, move: Move) -> list[tuple[Slot, Slot, int]]:
        """(source, destination, bytes) of every transfer in `move`."""
        group = self.plan.groups[move.group]
        pattern = self.plan.pattern_of(group)
        if isinstance(move, Segment):
            count = group.itemsize * (move.stop - move.first)
            return [(p.src, p.dst, volume(p.box) * count) for p in pattern.network]
        p = pattern.network[move.piece]
        return [(p.src, p.dst, volume(move.box) * group.itemsize)]

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


class _Rounds:
    """First-fit packing of moves with per-slot loads into rounds of `budget` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.moves: list[list[Move]] = []
        self.used: list[dict[Slot, int]] = []

    def _fits(self, r: int, load: dict[Slot, int]) -> int:
        """How many copies of `load` still fit into round r."""
        if r == len(self.moves):
            self.moves.append([])
            self.used.append(defaultdict(int))
        used = self.used[r]
        return min((self.budget - used[m]) // n for m, n in load.items())

    def _add(self, r: int, move: Move, load: dict[Slot, int], copies: int) -> None:
        self.moves[r].append(move)
        for m, n in load.items():
            self.used[r][m] += n * copies

    def place_tensors(self, group: int, count: int, load: dict[Slot, int]) -> None:
        """Place `count` tensors of equal per-member `load`, as few segments as possible."""
        first, r = 0, 0
        while first < count:
            take = min(self._fits(r, load), count - first)
            if take > 0:
                self._add(r, Segment(group, first, first + take), load, take)
                first += take
            r += 1

    def place_chunk(self, chunk: Chunk, load: dict[Slot, int], start: int) -> int:
        """Place one chunk in the first round from `start` with room; return that round.

        Usage only grows, so the next chunk of the same load cannot fit before this round.
        """
        r = start
        while self._fits(r, load) < 1:
            r += 1
        self._add(r, chunk, load, 1)
        return r


def build_schedule(plan: Plan, budget: int) -> Schedule:
    """Cut `plan`'s network pieces into rounds of at most `budget` buffer bytes per slot."""
    if budget < 1:
        raise InvalidInput(f"budget must be a positive number of bytes, got {budget}")
    rounds = _Rounds(budget)
    for g, group in enumerate(plan.groups):
        pattern = plan.pattern_of(group)
        if not pattern.network:
            continue
        sends, recvs = pattern.slot_elements
        load = {m: 0 for m in (*sends, *recvs)}
        for m, n in (*sends.items(), *recvs.items()):
            load[m] += n * group.itemsize
        if max(load.values()) <= budget:
            rounds.place_tensors(g, len(group.tensors), load)
            continue
        for tensor in range(len(group.tensors)):
            ref = group.tensors.tensor(tensor)
            for i, p in enumerate(pattern.network):
                start = 0
                for box in _chunks(plan, ref, p.box, group.itemsize, budget):
                    n = volume(box) * group.itemsize
                    load = {p.src: n, p.dst: n}
                    start = rounds.place_chunk(Chunk(g, tensor, i, box), load, start)
    return Schedule(plan, budget, tuple(tuple(moves) for moves in rounds.moves))


def _chunks(plan: Plan, ref: TensorRef, box: Box, itemsize: int, budget: int) -> list[Box]:
    rows = box[0][1] - box[0][0]
    row_bytes = volume(box) // rows * itemsize
    if row_bytes > budget:
        name = plan.spec.tensor_name(ref)
        raise InvalidInput(
            f"budget {budget} bytes is below one row ({row_bytes} bytes) of {name}; "
            "raise the budget"
        )
    return split_rows(box, budget // row_bytes)
