"""Transfer plans: which member sends which box of which logical tensor when the layout changes.

A plan is a pure function of (model spec, old layout, new layout). Members are numbered in the
*union*: the old members in old rank order, then the members only the new layout has. Members in
both layouts keep what they hold (a local copy); every other byte a new rank needs comes from one
old holder. Tensors with the same placement under both layouts form a class whose pieces are
computed once (`Matching`), so planning cost follows the number of distinct pieces, not
ranks x tensors. `plan_view` gives one member's part of the plan without the other members'.

Invariants (property-tested): every byte of every new region is covered exactly once; network
bytes equal the lower bound (bytes a member needs and did not hold); the digest is identical
wherever the plan is computed.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from ..layout.layout import Layout
from ..layout.region import Placed, owner_of, partition, place, rank_boxes, stages_of
from ..vps.box import Box, intersect, volume
from ..vps.spec import ModelSpec, StateKind, TensorRef
from .matching import LostPiece, Matching, Partition, Transfer

PLANNER_VERSION = 1


@dataclass(frozen=True)
class Pattern:
    """The pieces of one tensor class, shared by every tensor of the class."""

    transfers: tuple[Transfer, ...]

    @cached_property
    def network(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.src != t.dst)

    @cached_property
    def local_elements(self) -> int:
        return sum(volume(t.box) for t in self.transfers if t.src == t.dst)

    @cached_property
    def member_elements(self) -> tuple[dict[int, int], dict[int, int]]:
        """Elements each member sends and receives over the network, per tensor."""
        sends: dict[int, int] = defaultdict(int)
        recvs: dict[int, int] = defaultdict(int)
        for t in self.network:
            n = volume(t.box)
            sends[t.src] += n
            recvs[t.dst] += n
        return dict(sends), dict(recvs)

    @cached_property
    def local_by_member(self) -> dict[int, tuple[Transfer, ...]]:
        """The local copies of each member, per tensor."""
        out: dict[int, list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            if t.src == t.dst:
                out[t.src].append(t)
        return {m: tuple(ts) for m, ts in out.items()}

    @cached_property
    def by_member(self) -> dict[int, tuple[int, ...]]:
        """Indices of the network transfers each member takes part in."""
        out: dict[int, list[int]] = defaultdict(list)
        for i, t in enumerate(self.network):
            out[t.src].append(i)
            out[t.dst].append(i)
        return {m: tuple(ix) for m, ix in out.items()}


@dataclass(frozen=True)
class PlanGroup:
    """A class of tensors and the pattern of pieces they share."""

    pattern: int  # index into Plan.patterns
    tensors: TensorClass

    @property
    def itemsize(self) -> int:
        return self.tensors.itemsize


def union_members(old: Layout, new: Layout, lost: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Old members in old rank order, then the members only the new layout has; members that
    are `lost` (died with their state) take no part."""
    present = set(old.members)
    return tuple(m for m in old.members if m not in lost) + tuple(
        m for m in new.members if m not in present
    )


def _check_lost(old: Layout, new: Layout, lost: frozenset[str]) -> None:
    unknown = sorted(lost - set(old.members))
    if unknown:
        raise ValueError(f"lost members {unknown} are not members of the old layout")
    back = sorted(lost & set(new.members))
    if back:
        raise ValueError(f"lost members {back} cannot be members of the new layout")


@dataclass(frozen=True)
class TensorClass:
    """Tensors placed alike under both layouts: every kind in `kinds` of every param in `params`."""

    old: Placed
    new: Placed
    itemsize: int
    params: tuple[int, ...]
    kinds: tuple[StateKind, ...]

    def __len__(self) -> int:
        return len(self.params) * len(self.kinds)

    def tensor(self, i: int) -> TensorRef:
        """The i-th tensor of the class: params outer, kinds inner (the canonical order)."""
        param, kind = divmod(i, len(self.kinds))
        return TensorRef(self.params[param], self.kinds[kind])

    @property
    def tensors(self) -> list[TensorRef]:
        return [TensorRef(p, k) for p in self.params for k in self.kinds]


# Kinds that ZeRO shards alike and store in one dtype: the parameter, and its fp32 state.
_KIND_SETS = ((StateKind.PARAM,), (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ))


def _classes(spec: ModelSpec, old: Layout, new: Layout) -> list[TensorClass]:
    """Every logical tensor, grouped into classes, in the order of each class's first tensor.

    Placement is computed once per distinct (param signature, stage, expert owner), not per tensor:
    this loop runs over every parameter of a 235B model.
    """
    by_key: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, p in enumerate(spec.params):
        where = (
            stages_of(old, p),
            owner_of(spec, old, p),
            stages_of(new, p),
            owner_of(spec, new, p),
        )
        by_key[(p.shape, p.split_dim, p.parts, *where)].append(i)
    classes: dict[tuple[Placed, Placed, int, tuple[StateKind, ...]], list[int]] = {}
    for params in by_key.values():
        param = spec.params[params[0]]
        for kinds in _KIND_SETS:
            key = (
                place(spec, old, param, kinds[0]),
                place(spec, new, param, kinds[0]),
                spec.dtype(kinds[0]).itemsize,
                kinds,
            )
            classes.setdefault(key, []).extend(params)
    out = [
        TensorClass(o, n, size, tuple(sorted(ps)), ks) for (o, n, size, ks), ps in classes.items()
    ]
    return sorted(out, key=lambda c: (c.params[0], c.kinds[0] is not StateKind.PARAM))


class _Partitions:
    """Partitions of the old and new layout in union member indices, computed once per placement."""

    def __init__(self, old: Layout, new: Layout, union: tuple[str, ...]) -> None:
        self.old_layout, self.new_layout = old, new
        position = {m: i for i, m in enumerate(union)}
        self.new_to_union = [position[m] for m in new.members]
        # Old ranks are union indices unless members were lost; then lost holders drop out.
        self.old_to_union = [position.get(m) for m in old.members]
        self.identity = old.members == union[: old.world_size]
        self._old: dict[Placed, Partition] = {}
        self._new: dict[Placed, Partition] = {}
        self._matchings: dict[tuple[Placed, Placed], Matching] = {}

    def old(self, placed: Placed) -> Partition:
        if placed not in self._old:
            boxes = partition(self.old_layout, placed)
            if not self.identity:
                to_union = self.old_to_union
                boxes = [
                    (box, tuple(u for u in (to_union[r] for r in ranks) if u is not None))
                    for box, ranks in boxes
                ]
            self._old[placed] = boxes
        return self._old[placed]

    def new(self, placed: Placed) -> Partition:
        if placed not in self._new:
            to_union = self.new_to_union
            self._new[placed] = [
                (box, tuple(to_union[r] for r in ranks))
                for box, ranks in partition(self.new_layout, placed)
            ]
        return self._new[placed]

    def matching(self, old: Placed, new: Placed) -> Matching:
        key = (old, new)
        if key not in self._matchings:
            self._matchings[key] = Matching(self.old(old), self.new(new))
        return self._matchings[key]


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    old: Layout
    new: Layout
    members: tuple[str, ...]  # the union
    patterns: tuple[Pattern, ...]
    groups: tuple[PlanGroup, ...] = field(repr=False)
    lost: frozenset[str] = frozenset()

    def items(self) -> list[tuple[TensorRef, int, Transfer]]:
        """Every (tensor, itemsize, piece) of the plan, expanded; for tests on small models."""
        return [
            (ref, g.itemsize, t)
            for g in self.groups
            for ref in g.tensors.tensors
            for t in self.patterns[g.pattern].transfers
        ]

    def local_copies(self, member: int) -> list[tuple[TensorRef, Transfer]]:
        """What `member` (a union index) copies from its old state into its new one."""
        return [
            (ref, t)
            for g in self.groups
            for t in self.patterns[g.pattern].local_by_member.get(member, ())
            for ref in g.tensors.tensors
        ]

    @cached_property
    def network_transfers(self) -> int:
        return sum(len(g.tensors) * len(self.patterns[g.pattern].network) for g in self.groups)

    def _bytes(self, elements: int, group: PlanGroup) -> int:
        return elements * group.itemsize * len(group.tensors)

    @cached_property
    def network_bytes(self) -> int:
        return sum(
            self._bytes(sum(volume(t.box) for t in self.patterns[g.pattern].network), g)
            for g in self.groups
        )

    @cached_property
    def local_bytes(self) -> int:
        return sum(self._bytes(self.patterns[g.pattern].local_elements, g) for g in self.groups)

    @cached_property
    def member_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        """Network bytes each member sends and receives in the whole plan."""
        sends: dict[int, int] = defaultdict(int)
        recvs: dict[int, int] = defaultdict(int)
        for g in self.groups:
            pattern_sends, pattern_recvs = self.patterns[g.pattern].member_elements
            for member, n in pattern_sends.items():
                sends[member] += self._bytes(n, g)
            for member, n in pattern_recvs.items():
                recvs[member] += self._bytes(n, g)
        return dict(sends), dict(recvs)

    @cached_property
    def digest(self) -> str:
        """SHA-256 over the plan's full content; members compare it before moving any byte."""
        h = hashlib.sha256()
        h.update(
            repr(
                (PLANNER_VERSION, self.spec.digest, self.old.describe(), self.new.describe(),
                 self.members, self.old.members, self.new.members, sorted(self.lost))
            ).encode()
        )  # fmt: skip
        encoded = [repr(p.transfers).encode() for p in self.patterns]
        for g in self.groups:
            # Tensors by index and kind: the spec digest above fixes what the indices name.
            kinds = [k.value for k in g.tensors.kinds]
            h.update(repr((g.itemsize, g.tensors.params, kinds)).encode())
            h.update(encoded[g.pattern])
        return h.hexdigest()


def build_plan(
    spec: ModelSpec, old: Layout, new: Layout, lost: frozenset[str] = frozenset()
) -> Plan:
    """The full plan from `old` to `new`; both layouts must be feasible for `spec`.

    `lost` members died with their state: the plan takes every byte from surviving copies, and
    raises ValueError naming a tensor that has none.
    """
    old.check(spec)
    new.check(spec)
    _check_lost(old, new, lost)
    members = union_members(old, new, lost)
    parts = _Partitions(old, new, members)
    pattern_index: dict[tuple[Placed, Placed], int] = {}
    patterns: list[Pattern] = []
    groups = []
    for cls in _classes(spec, old, new):
        key = (cls.old, cls.new)
        if key not in pattern_index:
            pattern_index[key] = len(patterns)
            try:
                transfers = parts.matching(cls.old, cls.new).transfers()
            except LostPiece as err:
                name = spec.tensor_name(cls.tensor(0))
                raise ValueError(
                    f"no surviving copy of {name} {list(err.box)} (and of every tensor placed "
                    f"like it): every member that held it is lost ({sorted(lost)}); "
                    "restore from a checkpoint"
                ) from None
            patterns.append(Pattern(transfers))
        groups.append(PlanGroup(pattern_index[key], cls))
    return Plan(spec, old, new, members, tuple(patterns), tuple(groups), lost)


@dataclass(frozen=True)
class PlanView:
    """One member's part of a plan: what it copies locally, sends and receives."""

    member: str
    index: int  # in the union
    local: tuple[tuple[TensorRef, Transfer], ...]
    sends: tuple[tuple[TensorRef, Transfer], ...]
    recvs: tuple[tuple[TensorRef, Transfer], ...]


def plan_view(
    spec: ModelSpec, old: Layout, new: Layout, member: str, lost: frozenset[str] = frozenset()
) -> PlanView:
    """`member`'s part of the plan, computed from the classes it takes part in only."""
    old.check(spec)
    new.check(spec)
    _check_lost(old, new, lost)
    members = union_members(old, new, lost)
    if member not in members:
        raise ValueError(f"member {member!r} is a live member of neither layout")
    index = members.index(member)
    old_rank = old.members.index(member) if member in old.members else None
    new_rank = new.members.index(member) if member in new.members else None
    parts = _Partitions(old, new, members)
    cache: dict[tuple[Placed, Placed], list[Transfer]] = {}
    local: list[tuple[TensorRef, Transfer]] = []
    sends: list[tuple[TensorRef, Transfer]] = []
    recvs: list[tuple[TensorRef, Transfer]] = []
    for cls in _classes(spec, old, new):
        key = (cls.old, cls.new)
        if key not in cache:
            cache[key] = _member_transfers(parts, cls.old, cls.new, old_rank, new_rank, index)
        for t in cache[key]:
            bucket = local if t.src == t.dst else sends if t.src == index else recvs
            bucket += [(ref, t) for ref in cls.tensors]
    return PlanView(member, index, tuple(local), tuple(sends), tuple(recvs))


def _member_transfers(
    parts: _Partitions,
    placed_old: Placed,
    placed_new: Placed,
    old_rank: int | None,
    new_rank: int | None,
    index: int,
) -> list[Transfer]:
    held = [] if old_rank is None else rank_boxes(parts.old_layout, placed_old, old_rank)
    needed = [] if new_rank is None else rank_boxes(parts.new_layout, placed_new, new_rank)
    if not held and not needed:
        return []
    matching = parts.matching(placed_old, placed_new)
    old_index = {box: j for j, (box, _) in enumerate(matching.old)}
    new_index = {box: k for k, (box, _) in enumerate(matching.new)}
    return matching.transfers_of(
        index, [old_index[b] for b in held], [new_index[b] for b in needed]
    )


def lower_bound_bytes(spec: ModelSpec, old: Layout, new: Layout) -> int:
    """Bytes that new ranks need and did not hold themselves, from rank regions alone.

    Independent of the matching: it is the figure the plan's network bytes must equal.
    """
    old_rank = {m: r for r, m in enumerate(old.members)}
    stage_size = new.dp * new.tp
    total = 0
    for cls in _classes(spec, old, new):
        missing = 0
        for stage in cls.new.stages:
            for rank in range(stage * stage_size, (stage + 1) * stage_size):
                member = new.members[rank]
                needed = rank_boxes(new, cls.new, rank)
                held: list[Box] = []
                if member in old_rank:
                    held = rank_boxes(old, cls.old, old_rank[member])
                for box in needed:
                    overlap = (intersect(box, h) for h in held)
                    missing += volume(box) - sum(volume(o) for o in overlap if o is not None)
        total += missing * cls.itemsize * len(cls)
    return total
