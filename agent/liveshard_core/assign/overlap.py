"""Overlaps: the bytes an old member keeps when it takes a new rank, for every pair at once.

If the old member at old rank `o` takes new rank `r`, it already holds `W[o, r]` bytes of what `r`
needs; everything else `r` needs crosses the network. `W` is never built as ranks x ranks: it is
a sum of four terms that follow how layouts replicate state.

- A *coarse class* is a rank's `(stage, tp index, ep rank)`; ranks of one class hold the same
  boxes of every tensor that ZeRO does not shard (they differ only in their ZeRO shards).
- `W[o, r] = R[k(o), k'(r)] + T[o, k'(r)] + U[k(o), r] + S[o, r]`, where `k`, `k'` are the coarse
  classes under the old and new layout; `R` comes from boxes unsharded on both sides (replicas),
  `T` from boxes sharded only under the old layout, `U` only under the new one, and `S` (sparse)
  from boxes sharded on both.

The boxes come from the same placement rules as `layout.region`, one class of tensors at a time
(`plan.classes`), so the overlaps are exact. The box geometry of a placement does not depend on
the stages that hold it, so it is computed once per placement and shifted to each stage. This
module must not choose an assignment.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise, product

import numpy as np
import numpy.typing as npt

from ..layout.layout import Layout
from ..layout.region import (
    Placed,
    holder_dps,
    holder_eps,
    holder_tps,
    tp_local_boxes,
    zero_shard_boxes,
)
from ..plan.classes import tensor_classes
from ..vps.box import Box, Interval, intersect, is_empty, volume
from ..vps.spec import ModelSpec

Ints = npt.NDArray[np.int64]


class BoxGrid:
    """Finds which boxes of a partition overlap a query box, one dimension at a time."""

    def __init__(self, boxes: list[Box]) -> None:
        ndim = len(boxes[0])
        self.intervals: list[list[Interval]] = []
        self.starts: list[list[int]] = []
        index: list[dict[Interval, int]] = []
        for dim in range(ndim):
            intervals = sorted({box[dim] for box in boxes})
            for (_, stop), (start, _) in pairwise(intervals):
                if start < stop:
                    raise ValueError(f"boxes overlap partially on dim {dim}: not a partition")
            self.intervals.append(intervals)
            self.starts.append([start for start, _ in intervals])
            index.append({iv: i for i, iv in enumerate(intervals)})
        self.cells = {
            tuple(index[d][box[d]] for d in range(ndim)): j for j, box in enumerate(boxes)
        }

    def overlapping(self, box: Box) -> list[int]:
        ranges = []
        for dim, (lo, hi) in enumerate(box):
            starts, intervals = self.starts[dim], self.intervals[dim]
            i = max(bisect_right(starts, lo) - 1, 0)
            hits = []
            while i < len(intervals) and intervals[i][0] < hi:
                if intervals[i][1] > lo:
                    hits.append(i)
                i += 1
            ranges.append(hits)
        cells = self.cells
        return [cells[c] for c in product(*ranges) if c in cells]


def coarse_classes(layout: Layout) -> Ints:
    """Every rank's coarse class `(stage * tp + tp index) * ep + ep rank`, in rank order."""
    ranks = np.arange(layout.world_size, dtype=np.int64)
    rest, tp_i = np.divmod(ranks, layout.tp)
    pp_i, dp_i = np.divmod(rest, layout.dp)
    out: Ints = (pp_i * layout.tp + tp_i) * layout.ep + dp_i % layout.ep
    return out


@dataclass(frozen=True)
class _Side:
    """A placement's boxes on stage 0, each with its volume and who holds it there: coarse
    classes for a replicated box, ranks for a ZeRO shard."""

    boxes: list[tuple[tuple[int, int], ...]]
    sharded: bool
    who: list[list[int]]
    stage_step: int  # what one stage adds to a class (replicated) or a rank (sharded)


def _side(layout: Layout, placed: Placed) -> _Side:
    """Stage-0 boxes of a tensor under `layout`, as `region.partition` finds them."""
    owner = placed.ep_owner
    group = range(layout.dp) if owner is None else range(owner, layout.dp, layout.ep)
    tp_keys: list[int | None] = list(range(layout.tp)) if placed.split_dim is not None else [None]
    eps = holder_eps(layout, placed)
    boxes, who = [], []
    for tp_key in tp_keys:
        tps = holder_tps(layout, placed, tp_key)
        local = tp_local_boxes(placed, layout.tp, tp_key)
        if placed.sharded:
            mirrored = layout.mirror and len(group) > 1
            for z in range(len(group)):
                dps = holder_dps(layout, placed, group, z, mirrored)
                ranks = [layout.rank(0, d, t) for d in dps for t in tps]
                for box in zero_shard_boxes(placed, local, len(group), z):
                    if not is_empty(box):
                        boxes.append(box)
                        who.append(ranks)
        else:
            classes = [t * layout.ep + e for t in tps for e in eps]
            for box in local:
                if not is_empty(box):
                    boxes.append(box)
                    who.append(classes)
    step = layout.dp * layout.tp if placed.sharded else layout.tp * layout.ep
    return _Side(boxes, placed.sharded, who, step)


@dataclass(frozen=True)
class _Geometry:
    """The overlaps of two placements on stage 0: index arrays of (old holder, new holder) pairs
    and elements, and what each new holder needs."""

    old: _Side
    new: _Side
    pair_old: Ints
    pair_new: Ints
    pair_elements: Ints
    need_who: Ints
    need_elements: Ints


def _geometry(old: _Side, new: _Side) -> _Geometry:
    need_who = [w for who in new.who for w in who]
    need_elements = [volume(box) for box, who in zip(new.boxes, new.who, strict=True) for _ in who]
    pair_old: list[int] = []
    pair_new: list[int] = []
    pair_elements: list[int] = []
    if old.boxes and new.boxes:
        grid = BoxGrid(old.boxes)
        for box, news in zip(new.boxes, new.who, strict=True):
            for j in grid.overlapping(box):
                overlap = intersect(old.boxes[j], box)
                assert overlap is not None
                n = volume(overlap)
                for o in old.who[j]:
                    pair_old += [o] * len(news)
                    pair_new += news
                    pair_elements += [n] * len(news)
    return _Geometry(
        old, new, *(np.array(a, dtype=np.int64)
                    for a in (pair_old, pair_new, pair_elements, need_who, need_elements)),
    )  # fmt: skip


@dataclass(frozen=True)
class Overlaps:
    """`W` between every old rank and every new rank, as the module docstring states it."""

    old_class: Ints  # coarse class of each old rank
    new_class: Ints  # coarse class of each new rank
    replicated: Ints  # R: old classes x new classes
    old_sharded: Ints | None  # T: old ranks x new classes, or None when zero
    new_sharded: Ints | None  # U: old classes x new ranks, or None when zero
    sharded: tuple[Ints, Ints, Ints]  # S: (new ranks, old ranks, bytes), sorted, unique pairs
    needed: Ints  # bytes each new rank needs in all

    def column(self, rank: int, old_ranks: Ints) -> Ints:
        """`W[o, rank]` for every `o` in `old_ranks` (sorted)."""
        classes = self.old_class[old_ranks]
        out: Ints = self.replicated[classes, self.new_class[rank]]
        if self.old_sharded is not None:
            out = out + self.old_sharded[old_ranks, self.new_class[rank]]
        if self.new_sharded is not None:
            out = out + self.new_sharded[classes, rank]
        news, olds, values = self.sharded
        lo, hi = np.searchsorted(news, [rank, rank + 1])
        if hi > lo and len(old_ranks):
            out = out.copy()
            _scatter(out, old_ranks, olds[lo:hi], values[lo:hi])
        return out

    def row(self, old_rank: int) -> Ints:
        """`W[old_rank, r]` for every new rank `r`."""
        k = self.old_class[old_rank]
        out: Ints = self.replicated[k, self.new_class]
        if self.old_sharded is not None:
            out = out + self.old_sharded[old_rank, self.new_class]
        if self.new_sharded is not None:
            out = out + self.new_sharded[k, :]
        news, olds, values = self.sharded
        mine = olds == old_rank
        if mine.any():
            out = out.copy()
            np.add.at(out, news[mine], values[mine])
        return out

    def matrix(self, old_ranks: Ints, new_ranks: Ints) -> Ints:
        """`W[o, r]` as a dense (`new_ranks` x `old_ranks`) array; both sorted."""
        classes = self.old_class[old_ranks]
        new_classes = self.new_class[new_ranks]
        out: Ints = self.replicated[np.ix_(classes, new_classes)].T.copy()
        if self.old_sharded is not None:
            out += self.old_sharded[np.ix_(old_ranks, new_classes)].T
        if self.new_sharded is not None:
            out += self.new_sharded[np.ix_(classes, new_ranks)].T
        news, olds, values = self.sharded
        if len(old_ranks) and len(new_ranks) and len(news):
            rows = np.searchsorted(new_ranks, news)
            cols = np.searchsorted(old_ranks, olds)
            hit = (rows < len(new_ranks)) & (cols < len(old_ranks))
            hit &= new_ranks[np.minimum(rows, len(new_ranks) - 1)] == news
            hit &= old_ranks[np.minimum(cols, len(old_ranks) - 1)] == olds
            np.add.at(out, (rows[hit], cols[hit]), values[hit])
        return out

    def components(self) -> tuple[Ints, Ints]:
        """A component number for every old rank and every new rank: `W` is zero between
        ranks of different components."""
        old_k, new_k = self.replicated.shape
        parent = list(range(old_k + new_k))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        edges = [np.argwhere(self.replicated > 0)]
        if self.old_sharded is not None:
            o, k = np.nonzero(self.old_sharded)
            edges.append(np.stack((self.old_class[o], k), axis=1))
        if self.new_sharded is not None:
            k, r = np.nonzero(self.new_sharded)
            edges.append(np.stack((k, self.new_class[r]), axis=1))
        news, olds, _ = self.sharded
        edges.append(np.stack((self.old_class[olds], self.new_class[news]), axis=1))
        for a, b in np.unique(np.concatenate(edges), axis=0).tolist():
            ra, rb = find(a), find(old_k + b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        roots = np.array([find(x) for x in range(old_k + new_k)], dtype=np.int64)
        return roots[self.old_class], roots[old_k + self.new_class]

    def pair(self, old_rank: int, new_rank: int) -> int:
        """`W[old_rank, new_rank]`."""
        return int(self.column(new_rank, np.array([old_rank], dtype=np.int64))[0])


def overlaps(spec: ModelSpec, old: Layout, new: Layout) -> Overlaps:
    """The overlaps between `old`'s ranks and `new`'s ranks for `spec`'s training state."""
    weights: dict[tuple[Placed, Placed], int] = defaultdict(int)
    for cls in tensor_classes(spec, old, new):
        weights[(cls.old, cls.new)] += cls.itemsize * len(cls)
    acc = _Accumulator(old, new)
    for (placed_old, placed_new), weight in weights.items():
        acc.add(placed_old, placed_new, weight)
    return acc.result()


def _stage0(placed: Placed) -> Placed:
    return dataclasses.replace(placed, stages=(0,))


class _Accumulator:
    def __init__(self, old: Layout, new: Layout) -> None:
        self.old, self.new = old, new
        old_k, new_k = old.pp * old.tp * old.ep, new.pp * new.tp * new.ep
        self.replicated = np.zeros((old_k, new_k), dtype=np.int64)
        self.old_sharded: Ints | None = None
        self.new_sharded: Ints | None = None
        self.pairs: list[tuple[Ints, Ints, Ints]] = []
        self.needed_class = np.zeros(new_k, dtype=np.int64)
        self.needed_rank = np.zeros(new.world_size, dtype=np.int64)
        self._sides: dict[tuple[bool, Placed], _Side] = {}
        self._geometries: dict[tuple[Placed, Placed], _Geometry] = {}

    def _side(self, is_new: bool, placed: Placed) -> _Side:
        key = (is_new, placed)
        if key not in self._sides:
            self._sides[key] = _side(self.new if is_new else self.old, placed)
        return self._sides[key]

    def add(self, placed_old: Placed, placed_new: Placed, weight: int) -> None:
        key = (_stage0(placed_old), _stage0(placed_new))
        if key not in self._geometries:
            self._geometries[key] = _geometry(self._side(False, key[0]), self._side(True, key[1]))
        geo = self._geometries[key]
        for s in placed_new.stages:
            who = geo.need_who + s * geo.new.stage_step
            target = self.needed_rank if geo.new.sharded else self.needed_class
            np.add.at(target, who, geo.need_elements * weight)
        if not len(geo.pair_old):
            return
        values = geo.pair_elements * weight
        for s_old in placed_old.stages:
            olds = geo.pair_old + s_old * geo.old.stage_step
            for s_new in placed_new.stages:
                news = geo.pair_new + s_new * geo.new.stage_step
                self._add(geo.old.sharded, olds, geo.new.sharded, news, values)

    def _add(self, old_sharded: bool, olds: Ints, new_sharded: bool, news: Ints, n: Ints) -> None:
        if not old_sharded and not new_sharded:
            np.add.at(self.replicated, (olds, news), n)
        elif not new_sharded:
            if self.old_sharded is None:
                self.old_sharded = np.zeros(
                    (self.old.world_size, self.replicated.shape[1]), dtype=np.int64
                )
            np.add.at(self.old_sharded, (olds, news), n)
        elif not old_sharded:
            if self.new_sharded is None:
                self.new_sharded = np.zeros(
                    (self.replicated.shape[0], self.new.world_size), dtype=np.int64
                )
            np.add.at(self.new_sharded, (olds, news), n)
        else:
            self.pairs.append((news, olds, n))

    def result(self) -> Overlaps:
        new_class = coarse_classes(self.new)
        empty = np.zeros(0, dtype=np.int64)
        sharded = (empty, empty, empty)
        if self.pairs:
            news = np.concatenate([p[0] for p in self.pairs])
            olds = np.concatenate([p[1] for p in self.pairs])
            values = np.concatenate([p[2] for p in self.pairs])
            keys, inverse = np.unique(news * self.old.world_size + olds, return_inverse=True)
            summed = np.zeros(len(keys), dtype=np.int64)
            np.add.at(summed, inverse, values)
            key_new, key_old = np.divmod(keys, self.old.world_size)
            sharded = (key_new, key_old, summed)
        return Overlaps(
            old_class=coarse_classes(self.old),
            new_class=new_class,
            replicated=self.replicated,
            old_sharded=self.old_sharded,
            new_sharded=self.new_sharded,
            sharded=sharded,
            needed=self.needed_class[new_class] + self.needed_rank,
        )


def _scatter(out: Ints, old_ranks: Ints, olds: Ints, values: Ints) -> None:
    """Add `values` at the positions of `olds` in the sorted `old_ranks` (others are skipped)."""
    where = np.searchsorted(old_ranks, olds)
    hit = (where < len(old_ranks)) & (old_ranks[np.minimum(where, len(old_ranks) - 1)] == olds)
    np.add.at(out, where[hit], values[hit])
