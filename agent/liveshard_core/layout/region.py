"""Regions: the boxes of a logical tensor that a rank holds under a layout.

PP picks which tensors a rank holds at all; TP (and EP for experts) cuts boxes along a dimension;
DP replicates; ZeRO shards the rank's TP-local rows along dim 0 across its dp group (the expert-dp
group for experts), `torch.chunk` style. A fused dimension is split part by part, and a ZeRO
shard of a fused dim-0 tensor is a contiguous run of the local concatenation, so it may be two
boxes. A mirrored layout (`Layout.mirror`) has each ZeRO shard held also by the next member of
its group (shard z by group members z and z + 1, round), so a rank holds two cells of a sharded
tensor: its own shard and its predecessor's. A box no replica holds (a layout with dp = 1, an
expert of ep = dp) is held there also by its holder's *peer*, the next member along one axis,
round: dp for an expert (`"ep"`: ep = dp, so the next ep rank), else pp (the placement's stages
are then two), else tp for a split tensor (`Placed.peer == "tp"`).

Everything a tensor's boxes depend on is its `Placed` value; tensors with equal `Placed` values
under a layout have equal regions, which is what lets plans be computed once per class of tensors.

`Geometry` is a placement's partition looked up by arithmetic instead of enumerated: the boxes a
rank holds, the boxes that overlap a given box, and the holders of a box as a product of coordinate
ranges (`Holders`: its length, its i-th rank, a rank's position), each in time that follows the
answer, not the ranks (the holders of a replicated box number in the thousands at 10^5 ranks).
Every box has an *ordinal*, a number that depends only on how the box is cut (tp index, ZeRO shard,
fused part), so that any member computes the same one for it; boxes are listed in ordinal order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from ..vps.box import Box, chunk, full_box, intersect, is_empty, replace_dim
from ..vps.spec import ModelSpec, Param, Placement, StateKind, TensorRef
from .layout import Layout


@dataclass(frozen=True, slots=True)
class Placed:
    """All that a logical tensor's region under one layout depends on."""

    shape: tuple[int, ...]
    split_dim: int | None
    parts: tuple[int, ...] | None
    sharded: bool  # ZeRO shards it across the dp (or expert-dp) group
    stages: tuple[int, ...]  # the pipeline stages that hold it
    ep_owner: int | None  # for an expert: the ep rank that holds it
    peer: str = ""  # held once, mirrored by the next member along "tp" or "ep" (module docstring)


def stages_of(layout: Layout, param: Param) -> tuple[int, ...]:
    """The pipeline stages that hold `param` under `layout`."""
    if param.placement is Placement.LAYER:
        assert param.layer is not None
        return (layout.stage_of_layer[param.layer],)
    if param.placement is Placement.FIRST:
        return (0,)
    if param.placement is Placement.LAST:
        return (layout.pp - 1,)
    return (0, layout.pp - 1) if layout.pp > 1 else (0,)


def owner_of(spec: ModelSpec, layout: Layout, param: Param) -> int | None:
    """For an expert, the ep rank that holds it; None for every other parameter."""
    if param.expert is None:
        return None
    return param.expert // (spec.config.experts // layout.ep)


def place(
    spec: ModelSpec, layout: Layout, param: Param, kind: StateKind, peer: bool = True
) -> Placed:
    """The placement of `param`'s `kind` tensor under `layout`; with `peer` False, without the
    copy a mirrored layout gives a box no replica holds (what its holder computes with)."""
    placed = Placed(
        param.shape,
        param.split_dim,
        param.parts,
        kind.zero_sharded(layout.zero),
        stages_of(layout, param),
        owner_of(spec, layout, param),
    )
    return _with_peer(layout, placed) if peer and layout.mirror else placed


def _with_peer(layout: Layout, placed: Placed) -> Placed:
    """`placed` with its boxes held also by their holder's peer when no one else holds them: the
    next member along dp (an expert of ep = dp), else along pp, else along tp (a split tensor).
    dp and pp come first because they cross pods where tp groups stay inside one (`assign`),
    so that a pod's loss leaves a copy. Along pp, a tensor the stage's tp ranks hold alike (a
    norm) is copied on the next stage's tp ranks alike."""
    group = layout.dp if placed.ep_owner is None else layout.dp // layout.ep
    if len(placed.stages) > 1 or group > 1:
        return placed  # replicas hold it, or ZeRO shards over a group that mirrors them
    if layout.dp > 1:  # an expert of ep = dp
        return replace(placed, peer="ep")
    if layout.pp > 1:
        (stage,) = placed.stages
        return replace(placed, stages=tuple(sorted({stage, (stage + 1) % layout.pp})))
    if layout.tp > 1 and placed.split_dim is not None:
        return replace(placed, peer="tp")
    return placed  # the tp ranks hold it alike


def tp_local_boxes(placed: Placed, tp: int, tp_i: int | None) -> list[Box]:
    """Boxes of tp rank `tp_i` (None: a replicated tensor, the whole of it)."""
    whole = full_box(placed.shape)
    if tp_i is None or placed.split_dim is None:
        return [whole]
    dim = placed.split_dim
    parts = placed.parts or (placed.shape[dim],)
    boxes, offset = [], 0
    for size in parts:
        start, stop = chunk(size, tp, tp_i)
        boxes.append(replace_dim(whole, dim, (offset + start, offset + stop)))
        offset += size
    return boxes


def zero_shard_boxes(placed: Placed, local: list[Box], shards: int, index: int) -> list[Box]:
    """Shard `index` of `shards` of the TP-local boxes, cut along dim 0 of the local tensor."""
    return [box for _, box in shard_boxes(placed, local, shards, index)]


def shard_boxes(placed: Placed, local: list[Box], shards: int, index: int) -> list[tuple[int, Box]]:
    """`zero_shard_boxes`, each box with the index of the local box it comes from."""
    if placed.split_dim != 0:
        # Every local box spans dim 0 whole: the shard is the same rows of each.
        rows = chunk(placed.shape[0], shards, index)
        return [(b, replace_dim(box, 0, rows)) for b, box in enumerate(local)]
    # Dim 0 of the local tensor is the concatenation of the local boxes' dim-0 intervals.
    total = sum(box[0][1] - box[0][0] for box in local)
    lo, hi = chunk(total, shards, index)
    out, offset = [], 0
    for b, box in enumerate(local):
        start, stop = box[0]
        first, last = max(lo, offset), min(hi, offset + stop - start)
        if first < last:
            out.append((b, replace_dim(box, 0, (start + first - offset, start + last - offset))))
        offset += stop - start
    return out


@dataclass(frozen=True, slots=True)
class Holders:
    """The ranks that hold one box, in rank order: every `(stage, dp index, tp index)` of
    `stages x dps x tps` under a layout of `dp x tp` ranks per stage."""

    stages: tuple[int, ...]
    dps: range
    tps: range
    dp: int
    tp: int

    def __len__(self) -> int:
        return len(self.stages) * len(self.dps) * len(self.tps)

    def rank(self, i: int) -> int:
        """The i-th holder."""
        s, rest = divmod(i, len(self.dps) * len(self.tps))
        d, t = divmod(rest, len(self.tps))
        return (self.stages[s] * self.dp + self.dps[d]) * self.tp + self.tps[t]

    def index(self, rank: int) -> int | None:
        """The position of `rank` among the holders, or None when it holds no copy."""
        rest, t = divmod(rank, self.tp)
        s, d = divmod(rest, self.dp)
        if s not in self.stages or d not in self.dps or t not in self.tps:
            return None
        return (self.stages.index(s) * len(self.dps) + self.dps.index(d)) * len(
            self.tps
        ) + self.tps.index(t)

    def ranks(self) -> tuple[int, ...]:
        tp, dp = self.tp, self.dp
        return tuple((s * dp + d) * tp + t for s in self.stages for d in self.dps for t in self.tps)


Entry = tuple[int, Box, Holders]
"""One box of a partition: its ordinal, the box and its holders."""


Cell = tuple[int, int]
"""A tp index and a ZeRO shard (0 and 0 where the tensor is not split or not sharded): the
boxes of one cell have the same holders."""


def pair(a: int, b: int) -> range:
    """Two distinct indices in order, as a range."""
    a, b = sorted((a, b))
    return range(a, b + 1, b - a)


def shard_dps(group: range, z: int, mirrored: bool) -> range:
    """The dp indices that hold ZeRO shard `z` of a shard `group`: its member of the group, and
    when `mirrored` the next one, round."""
    if not mirrored:
        return group[z : z + 1]
    return pair(group[z], group[(z + 1) % len(group)])


def holder_dps(layout: Layout, placed: Placed, group: range, z: int, mirrored: bool) -> range:
    """The dp indices that hold the boxes of ZeRO shard `z` (0 when not sharded) of a tensor
    whose dp (or expert-dp) group is `group`."""
    if placed.peer == "ep":
        return pair(group[0], (group[0] + 1) % layout.dp)
    return shard_dps(group, z, mirrored) if placed.sharded else group


def holder_eps(layout: Layout, placed: Placed) -> range:
    """The ep ranks that hold the tensor: every one, or an expert's owner (and the next, round,
    when it mirrors it)."""
    owner = placed.ep_owner
    if owner is None:
        return range(layout.ep)
    return pair(owner, (owner + 1) % layout.ep) if placed.peer == "ep" else range(owner, owner + 1)


def holder_tps(layout: Layout, placed: Placed, t: int | None) -> range:
    """The tp indices that hold the boxes of tp index `t` (None: a tensor not split)."""
    if t is None:
        return range(layout.tp)
    return pair(t, (t + 1) % layout.tp) if placed.peer == "tp" else range(t, t + 1)


class Geometry:
    """The partition of the tensors placed as `placed` under `layout`."""

    def __init__(self, layout: Layout, placed: Placed) -> None:
        self.layout, self.placed = layout, placed
        owner = placed.ep_owner
        self.group = range(layout.dp) if owner is None else range(owner, layout.dp, layout.ep)
        self.split = placed.split_dim is not None
        self.shards = len(self.group) if placed.sharded else 1
        # Each shard held also by the next member of the group (a group of one has none).
        self.mirrored = placed.sharded and layout.mirror and self.shards > 1
        self.width = len(placed.parts or (0,)) if self.split else 1  # local boxes per tp index
        self._boxes: dict[Cell, list[tuple[int, Box]]] = {}
        self._holders: dict[Cell, Holders] = {}
        self._tp_boxes: dict[int, list[Box]] = {}

    def cells(self) -> list[Cell]:
        """Every cell, in ordinal order."""
        tps = range(self.layout.tp) if self.split else range(1)
        return [(t, z) for t in tps for z in range(self.shards)]

    def holders(self, cell: Cell) -> Holders:
        if cell not in self._holders:
            t, z = cell
            layout, placed = self.layout, self.placed
            dps = holder_dps(layout, placed, self.group, z, self.mirrored)
            tps = holder_tps(layout, placed, t if self.split else None)
            self._holders[cell] = Holders(placed.stages, dps, tps, layout.dp, layout.tp)
        return self._holders[cell]

    def _local(self, t: int) -> list[Box]:
        """The boxes of tp index `t` before ZeRO shards them (any tp index, when not split)."""
        if t not in self._tp_boxes:
            self._tp_boxes[t] = tp_local_boxes(
                self.placed, self.layout.tp, t if self.split else None
            )
        return self._tp_boxes[t]

    def cell_ranks(self) -> dict[Cell, tuple[int, ...]]:
        """Every cell's holders, in rank order (the whole partition's holders at once)."""
        layout, stages = self.layout, self.placed.stages
        dp, tp = layout.dp, layout.tp
        tps = range(tp) if self.split else range(1)
        if self.placed.sharded and not self.placed.peer:
            every = range(1) if self.split else range(tp)
            return {
                (t, z): tuple(
                    (s * dp + d) * tp + t + u for s in stages
                    for d in shard_dps(self.group, z, self.mirrored) for u in every
                )
                for t in tps
                for z in range(self.shards)
            }  # fmt: skip
        return {cell: self.holders(cell).ranks() for cell in self.cells()}

    def boxes(self, cell: Cell) -> list[tuple[int, Box]]:
        """(ordinal, box) of the non-empty boxes of `cell`."""
        if cell not in self._boxes:
            t, z = cell
            local = self._local(t)
            if self.placed.sharded:
                pairs = shard_boxes(self.placed, local, self.shards, z)
            else:
                pairs = list(enumerate(local))
            base = (t * self.shards + z) * self.width
            self._boxes[cell] = [(base + b, box) for b, box in pairs if not is_empty(box)]
        return self._boxes[cell]

    def entries(self) -> list[Entry]:
        """Every non-empty box with its holders, in ordinal order (the whole partition)."""
        return [
            (j, box, self.holders(cell)) for cell in self.cells() for j, box in self.boxes(cell)
        ]

    def cells_of(self, rank: int) -> list[Cell]:
        """The cells whose boxes `rank` holds, in ordinal order: one, or, mirrored, its own
        shard's and its predecessor's (its tp predecessor's, for a peer along tp); none when it
        holds no box of the tensor."""
        layout, placed = self.layout, self.placed
        pp_i, dp_i, tp_i = layout.coords(rank)
        dps = holder_dps(layout, placed, self.group, 0, False) if placed.peer else self.group
        if pp_i not in placed.stages or dp_i not in dps:
            return []
        t = tp_i if self.split else 0
        if placed.peer == "tp":
            return sorted({(t, 0), ((t - 1) % layout.tp, 0)})
        if not placed.sharded or placed.peer:
            return [(t, 0)]
        z = self.group.index(dp_i)
        if not self.mirrored:
            return [(t, z)]
        return sorted({(t, z), (t, (z - 1) % self.shards)})

    def of_rank(self, rank: int) -> list[Entry]:
        """The boxes `rank` holds, in ordinal order."""
        return [
            (j, box, self.holders(cell))
            for cell in self.cells_of(rank)
            for j, box in self.boxes(cell)
        ]

    def overlapping(self, query: Box) -> list[Entry]:
        """The boxes that overlap `query` (a box of the same tensor), in ordinal order."""
        return [
            (j, box, self.holders(cell))
            for cell in self.cells_overlapping(query)
            for j, box in self.boxes(cell)
            if intersect(box, query) is not None
        ]

    def cells_overlapping(self, query: Box) -> list[Cell]:
        """The cells that may hold part of `query`, in ordinal order."""
        return [
            (t, z) for t in self._tp_candidates(query) for z in self._shard_candidates(query, t)
        ]

    @cached_property
    def _parts(self) -> list[tuple[int, int]]:
        """(offset, size) of each fused part along the split dimension."""
        placed = self.placed
        assert placed.split_dim is not None
        out, offset = [], 0
        for size in placed.parts or (placed.shape[placed.split_dim],):
            out.append((offset, size))
            offset += size
        return out

    def _tp_candidates(self, query: Box) -> list[int]:
        if not self.split:
            return [0]
        assert self.placed.split_dim is not None
        tp = self.layout.tp
        lo, hi = query[self.placed.split_dim]
        found: set[int] = set()
        for offset, size in self._parts:
            a, b = max(lo, offset) - offset, min(hi, offset + size) - offset
            if a < b:
                step = -(-size // tp)
                found.update(range(a // step, min((b - 1) // step, tp - 1) + 1))
        return sorted(found)

    def _shard_candidates(self, query: Box, t: int) -> range | list[int]:
        if not self.placed.sharded:
            return range(1)
        lo, hi = query[0]
        if self.placed.split_dim != 0:
            rows = [(0, self.placed.shape[0])]
        else:
            rows = [box[0] for box in self._local(t)]
        # Rows of the local concatenation that the query covers, then the shards holding them.
        step = -(-sum(stop - start for start, stop in rows) // self.shards)
        found: set[int] = set()
        offset = 0
        for start, stop in rows:
            a, b = max(lo, start), min(hi, stop)
            if a < b and step:
                first, last = offset + a - start, offset + b - start - 1
                found.update(range(first // step, min(last // step, self.shards - 1) + 1))
            offset += stop - start
        return sorted(found)


def partition(layout: Layout, placed: Placed) -> list[tuple[Box, tuple[int, ...]]]:
    """The tensor's non-empty boxes, each with the sorted ranks that hold it: disjoint boxes that
    cover the tensor; replicas of a box are one entry with many holders."""
    return [(box, holders.ranks()) for _, box, holders in Geometry(layout, placed).entries()]


def rank_boxes(layout: Layout, placed: Placed, rank: int) -> list[Box]:
    """The non-empty boxes that `rank` holds, computed from its coordinates alone."""
    return [box for _, box, _ in Geometry(layout, placed).of_rank(rank)]


def region(spec: ModelSpec, layout: Layout, rank: int, ref: TensorRef) -> list[Box]:
    """The boxes of logical tensor `ref` that `rank` holds under `layout`."""
    param = spec.params[ref.param]
    return rank_boxes(layout, place(spec, layout, param, ref.kind), rank)
