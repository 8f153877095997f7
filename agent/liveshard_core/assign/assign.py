"""Member assignment: which surviving old member takes which new rank, and which become spares.

A change keeps some old members (the survivors) and may add new ones. Every new rank needs its
region; the member that takes it already holds `W[o, r]` bytes of it (`overlap`), and the rest
crosses the network. So the network bytes of a choice are `sum(needed) - sum(W[member, rank])`,
and the best choice is a maximum-weight assignment of survivors to new ranks, exactly `ranks -
joiners` of them, the other survivors left as spares.

Method (exact): a rectangular assignment problem with new ranks as rows and, as columns, the
survivors plus one column per joiner; a joiner keeps nothing but carries a bonus larger than any
overlap, so every joiner is placed and exactly the right number of survivors take ranks. It is
solved by shortest augmenting paths (`solver`), whose dual potentials prove the optimum; costs
are integer bytes. Rows are built from the compact overlap terms, never from per-rank regions.

Ties (assignments with equal network bytes) are broken toward a smaller busiest member: among
equal-byte exchanges of two ranks' members, one that lowers the most any member receives is
taken (a bounded local search; not proven minimal).

Lower bound: no assignment can keep more than the `k` largest per-rank best overlaps, nor more
than the `k` largest per-survivor best overlaps (`k` survivors take ranks), so
`sum(needed) - min(both)` bounds the network bytes of every assignment from below, independently
of the solver. It is what the figures compare with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInput
from ..layout.layout import Degrees, Layout
from ..vps.spec import ModelSpec
from .overlap import Ints, Overlaps, overlaps
from .solver import min_cost_assignment

# Below this many matrix entries the overlaps are laid out densely once (64 MiB of int64).
_DENSE_ENTRIES = 1 << 23
_TIE_PASSES = 64


@dataclass(frozen=True)
class Assignment:
    """Which old member takes each new rank; figures to recompute and compare the choice."""

    members_to: tuple[int | None, ...]  # per new rank: the old rank taking it, None: a joiner
    spares: tuple[int, ...]  # survivors that take no rank, ascending
    network_bytes: int  # bytes new ranks need that their members did not hold
    needed_bytes: int  # bytes all new ranks need
    lower_bound_bytes: int  # no assignment of these survivors needs fewer network bytes
    max_recv_bytes: int  # the most any new rank receives

    @property
    def kept_bytes(self) -> int:
        return self.needed_bytes - self.network_bytes


def _placeholder(shape: Layout | Degrees, spec: ModelSpec) -> Layout:
    """A layout of `shape`'s degrees with members named by rank: overlaps depend on coordinates
    only."""
    degrees = shape.degrees if isinstance(shape, Layout) else shape
    return degrees.layout(spec, [str(i) for i in range(shape.world_size)])


def _check(old_size: int, new_size: int, survivors: Sequence[int], joiners: int) -> None:
    bad = sorted({s for s in survivors if not 0 <= s < old_size})
    if bad:
        raise InvalidInput(f"survivors {bad}: old members are numbered 0..{old_size - 1}")
    if len(set(survivors)) != len(survivors):
        raise InvalidInput("survivors: a member is listed twice")
    if joiners < 0 or joiners > new_size:
        raise InvalidInput(f"joiners={joiners} must be between 0 and the {new_size} new ranks")
    if new_size - joiners > len(survivors):
        raise InvalidInput(
            f"{len(survivors)} remaining members + {joiners} added != {new_size} ranks of the "
            "new layout"
        )


class Problem:
    """One change's assignment problem: the overlaps between an old layout's ranks and a new
    layout's ranks, computed once, against which assignments are chosen and measured."""

    def __init__(self, spec: ModelSpec, old: Layout | Degrees, new: Layout | Degrees) -> None:
        self.old_size, self.new_size = old.world_size, new.world_size
        self.over = overlaps(spec, _placeholder(old, spec), _placeholder(new, spec))
        self._blocks: dict[tuple[tuple[int, ...], int], list[_Block]] = {}

    def best(self, survivors: Sequence[int], joiners: int) -> Assignment:
        """The assignment of `survivors` (old ranks) to the new ranks with the fewest network
        bytes, `joiners` new members taking the ranks no survivor takes."""
        blocks = self._prepare(survivors, joiners)
        cols = np.array(sorted(survivors), dtype=np.int64)
        members_to = _break_ties(self.over, cols, _solve(self.over, blocks, cols, joiners))
        return self._figures(members_to, survivors, blocks)

    def given(self, members_to: Sequence[int | None], survivors: Sequence[int]) -> Assignment:
        """The figures of a given assignment (old rank or None per new rank)."""
        joiners = sum(m is None for m in members_to)
        if len(members_to) != self.new_size or not {*members_to} - {None} <= {*survivors}:
            raise InvalidInput(
                f"members_to must name {self.new_size} new ranks' members among the survivors"
            )
        return self._figures(list(members_to), survivors, self._prepare(survivors, joiners))

    def _prepare(self, survivors: Sequence[int], joiners: int) -> list[_Block]:
        _check(self.old_size, self.new_size, survivors, joiners)
        key = (tuple(sorted(survivors)), joiners)
        if key not in self._blocks:
            self._blocks[key] = _blocks(self.over, np.array(key[0], dtype=np.int64), joiners)
        return self._blocks[key]

    def _figures(
        self, members_to: list[int | None], survivors: Sequence[int], blocks: list[_Block]
    ) -> Assignment:
        over = self.over
        kept = np.array([0 if m is None else over.pair(m, r) for r, m in enumerate(members_to)],
                        dtype=np.int64)  # fmt: skip
        recv = over.needed - kept
        placed = {m for m in members_to if m is not None}
        return Assignment(
            members_to=tuple(members_to),
            spares=tuple(sorted(int(s) for s in survivors if int(s) not in placed)),
            network_bytes=int(recv.sum()),
            needed_bytes=int(over.needed.sum()),
            lower_bound_bytes=_lower_bound(over, blocks, len(survivors), len(placed)),
            max_recv_bytes=int(recv.max(initial=0)),
        )


def best_assignment(
    spec: ModelSpec, old: Layout, new: Layout, survivors: Sequence[int], joiners: int
) -> Assignment:
    """`Problem(spec, old, new).best(survivors, joiners)`; `new`'s members are ignored."""
    return Problem(spec, old, new).best(survivors, joiners)


def placed_members(
    spec: ModelSpec,
    old: Layout,
    degrees: Degrees,
    survivors: Sequence[str],
    fresh: Callable[[], str],
) -> list[str]:
    """The members of `degrees`' layout in rank order: the `survivors` (members of `old`) placed
    to move the fewest bytes, a `fresh()` member on each rank none of them takes."""
    need = degrees.world_size - min(len(survivors), degrees.world_size)
    best = Problem(spec, old, degrees).best([old.rank_of(m) for m in survivors], need)
    return [old.members[m] if m is not None else fresh() for m in best.members_to]


def grouped_members(
    spec: ModelSpec, old: Layout, degrees: Degrees, slots: Sequence[Sequence[str]]
) -> list[str]:
    """The members of `degrees`' layout in rank order when each tensor-parallel group must be
    one of `slots` (tp members of one pod each, in tp order; a member of `old` is a survivor,
    any other a joiner): the groups that keep the most bytes, survivors before joiners (slots
    with more survivors take ranks first, as `placed_members` places every survivor it can).
    An exact assignment of slots to groups (`solver`), each slot's members in the given order;
    InvalidInput when there are fewer slots than groups, or a slot is not tp members."""
    tp, groups = degrees.tp, degrees.world_size // degrees.tp
    if any(len(slot) != tp for slot in slots) or len(slots) < groups:
        raise InvalidInput(
            f"{len(slots)} slots of tp={tp} members cannot fill the {groups} tensor-parallel "
            "groups of the new layout"
        )
    ranks = {m: r for r, m in enumerate(old.members)}
    survivors = np.array(sorted({ranks[m] for slot in slots for m in slot if m in ranks}),
                         dtype=np.int64)  # fmt: skip
    over = Problem(spec, old, degrees).over
    kept = over.matrix(survivors, np.arange(degrees.world_size, dtype=np.int64))
    column = {int(o): i for i, o in enumerate(survivors)}
    bonus = int(over.needed.sum()) + 1  # a survivor placed outweighs any bytes kept
    cost = np.zeros((groups, len(slots)), dtype=np.int64)
    for s, slot in enumerate(slots):
        for i, member in enumerate(slot):
            if member in ranks:
                rows = np.arange(groups) * tp + i
                cost[:, s] -= kept[rows, column[ranks[member]]] + bonus
    chosen = min_cost_assignment(groups, len(slots), lambda g: cost[g])
    return [member for g in range(groups) for member in slots[int(chosen[g])]]


def pod_slots(
    members: Sequence[str], tp: int, old: Layout | None, pod_of: Mapping[str, str] | None
) -> list[list[str]] | None:
    """`members` cut into tensor-parallel slots of one pod each (`pod_of`: a member's pod, itself
    when absent), for `grouped_members`: a pod's members in their `old` rank order (joiners
    after, by name), tp at a time; a pod's members left over fill no slot. None without pods or
    tp."""
    if not pod_of or tp == 1:
        return None
    ranks = {m: r for r, m in enumerate(old.members)} if old is not None else {}
    pods: dict[str, list[str]] = {}
    for member in members:
        pods.setdefault(pod_of.get(member, member), []).append(member)
    out = []
    for mates in pods.values():
        mates.sort(key=lambda m: (ranks.get(m, len(ranks)), m))
        out += [mates[i : i + tp] for i in range(0, len(mates) - tp + 1, tp)]
    return out


def pod_grouped_members(
    spec: ModelSpec,
    old: Layout,
    degrees: Degrees,
    members: Sequence[str],
    pod_of: Mapping[str, str] | None,
) -> list[str] | None:
    """The members of `degrees`' layout in rank order, each tensor-parallel group one pod's slot
    of `members` (`pod_slots`) placed to keep the most bytes (`grouped_members`); None without
    pods or tp, or when the pods hold too few whole groups."""
    slots = pod_slots(members, degrees.tp, old, pod_of)
    if slots is None or len(slots) * degrees.tp < degrees.world_size:
        return None
    return grouped_members(spec, old, degrees, slots)


def ordered_assignment(
    spec: ModelSpec, old: Layout, new: Layout, survivors: Sequence[int], joiners: int
) -> Assignment:
    """The survivors in the given order take the first ranks, joiners the rest; the survivors
    left over (the last ones) are spares."""
    taking = new.world_size - joiners
    _check(old.world_size, new.world_size, survivors, joiners)
    members_to = [*list(survivors)[:taking], *([None] * joiners)]
    return Problem(spec, old, new).given(members_to, survivors)


class _Block:
    """`W` between some new ranks (rows) and some survivors (columns): dense when small enough,
    else built a row at a time."""

    def __init__(self, over: Overlaps, rows: Ints, cols: Ints) -> None:
        self.over, self.rows, self.cols = over, rows, cols
        entries = len(rows) * max(len(cols), 1)
        self.dense = over.matrix(cols, rows) if entries <= _DENSE_ENTRIES else None

    def row(self, i: int) -> Ints:
        """`W[o, rows[i]]` for every survivor `o` of the block."""
        if self.dense is not None:
            out: Ints = self.dense[i]
            return out
        return self.over.column(int(self.rows[i]), self.cols)


def _blocks(over: Overlaps, cols: Ints, joiners: int) -> list[_Block]:
    """The components of `W`, each a block; one block of everything when the joiners outnumber
    the ranks that the components cannot fill from their own survivors (see `_solve`)."""
    old_comp, new_comp = over.components()
    ranks = np.arange(len(over.needed), dtype=np.int64)
    blocks = []
    short = 0
    for comp in np.unique(np.concatenate((old_comp[cols], new_comp))):
        rows = ranks[new_comp == comp]
        members = cols[old_comp[cols] == comp]
        short += max(len(rows) - len(members), 0)
        blocks.append((rows, members))
    if short < joiners:
        blocks = [(ranks, cols)]
    return [_Block(over, rows, members) for rows, members in blocks]


def _solve(over: Overlaps, blocks: list[_Block], cols: Ints, joiners: int) -> list[int | None]:
    """Blocks are independent: a survivor keeps nothing outside its own block. Each block fills
    as many of its ranks as it has survivors for, exactly (square or wide problem); the ranks
    left over take the joiners, then other blocks' spare survivors (who keep nothing there).
    Filling fewer ranks of a block never helps while joiners do not outnumber the leftover
    ranks; otherwise `_blocks` gave one block of everything, solved with a bonus column per
    joiner that is larger than any overlap, so every joiner is placed."""
    members_to: list[int | None] = [None] * len(over.needed)
    leftover: list[int] = []
    whole = len(blocks) == 1 and len(blocks[0].rows) == len(over.needed)
    for block in blocks:
        if not len(block.rows):
            continue
        extra = joiners if whole else max(len(block.rows) - len(block.cols), 0)
        bonus = int(over.needed.max(initial=0)) + 1 if whole else 0
        extra_costs = np.full(extra, -bonus, dtype=np.int64)
        if block.dense is not None:
            costs = np.empty((len(block.rows), len(block.cols) + extra), dtype=np.int64)
            np.negative(block.dense, out=costs[:, : len(block.cols)])
            costs[:, len(block.cols) :] = -bonus
            row_cost: Callable[[int], Ints] = costs.__getitem__
        else:

            def row_cost(i: int, block: _Block = block, extra_costs: Ints = extra_costs) -> Ints:
                costs: Ints = np.concatenate((-block.row(i), extra_costs))
                return costs

        chosen = min_cost_assignment(len(block.rows), len(block.cols) + extra, row_cost)
        for rank, c in zip(block.rows.tolist(), chosen.tolist(), strict=True):
            if c < len(block.cols):
                members_to[rank] = int(block.cols[c])
            else:
                leftover.append(rank)
    placed = {m for m in members_to if m is not None}
    spare = [int(m) for m in cols if int(m) not in placed]
    for rank in leftover[joiners:] if not whole else []:
        members_to[rank] = spare.pop(0)
    return members_to


def _break_ties(over: Overlaps, cols: Ints, members_to: list[int | None]) -> list[int | None]:
    """Exchange two ranks' members when it keeps the bytes and lowers the busiest receiver."""
    needed = over.needed
    out = list(members_to)
    if not len(cols) or not out:
        return out
    index = {int(m): i for i, m in enumerate(cols)}
    col_of = np.array([-1 if m is None else index[m] for m in out], dtype=np.int64)
    kept = np.array([0 if m is None else over.pair(m, r) for r, m in enumerate(out)],
                    dtype=np.int64)  # fmt: skip
    for _ in range(_TIE_PASSES):
        recv = needed - kept
        worst = int(np.argmax(recv))
        member = out[worst]
        # Exchanging members with rank r: `worst` gets r's member, r gets `worst`'s member.
        mine = over.column(worst, cols)
        gain_worst = np.where(col_of >= 0, mine[np.maximum(col_of, 0)], 0)
        gain_other = np.zeros(len(out), dtype=np.int64) if member is None else over.row(member)
        same_total = gain_worst + gain_other == kept[worst] + kept
        better = same_total & (
            np.maximum(needed[worst] - gain_worst, needed - gain_other) < recv[worst]
        )
        better[worst] = False
        if not better.any():
            break
        other = int(np.argmax(better))
        out[worst], out[other] = out[other], out[worst]
        col_of[worst], col_of[other] = col_of[other], col_of[worst]
        kept[worst], kept[other] = gain_worst[other], gain_other[other]
    return out


def _lower_bound(over: Overlaps, blocks: list[_Block], survivors: int, taking: int) -> int:
    total = int(over.needed.sum())
    if taking == 0 or survivors == 0:
        return total
    rank_best = np.zeros(len(over.needed), dtype=np.int64)
    member_best: list[Ints] = []
    for block in blocks:
        best = np.zeros(len(block.cols), dtype=np.int64)
        for i in range(len(block.rows)):
            values = block.row(i)
            if len(values):
                rank_best[block.rows[i]] = values.max()
                np.maximum(best, values, out=best)
        member_best.append(best)
    by_rank = int(np.sort(rank_best)[::-1][:taking].sum())
    by_member = int(np.sort(np.concatenate(member_best))[::-1][:taking].sum())
    return total - min(by_rank, by_member)
