"""Matching one class of tensors: which source sends which piece to which destination.

A class is every logical tensor with the same placement under the old and the new layout (say the
fp32 master of every `gate` in pipeline stage 3 that moves to stage 1); its pieces are computed
once and shared by all its tensors. The old layout's boxes partition the tensor; each box the new
layout needs is intersected with the old boxes it overlaps (found through a per-dimension grid,
so the cost follows the number of overlaps, not boxes squared). A destination that held an old box
copies locally; the others get the piece from one holder, spread round-robin and deterministically.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from itertools import pairwise, product
from typing import NamedTuple

from ..vps.box import Box, Interval, intersect


class Transfer(NamedTuple):
    """One piece of one logical tensor; `src == dst` is a local copy, anything else crosses the
    network. Members are indices into the plan's union of old and new members."""

    src: int
    dst: int
    box: Box


Partition = list[tuple[Box, tuple[int, ...]]]


class LostPiece(Exception):
    """A needed piece whose every holder is lost."""

    def __init__(self, box: Box) -> None:
        super().__init__(box)
        self.box = box


class _Grid:
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


class Matching:
    """The pieces of one tensor class between an old and a new partition (member indices).

    Overlaps are looked up on demand, so one member's part costs only the boxes it touches.
    """

    def __init__(self, old: Partition, new: Partition) -> None:
        self.old = old
        self.new = new
        self._old_grid = _Grid([box for box, _ in old])
        self._new_grid = _Grid([box for box, _ in new])

    def new_of_old(self, j: int) -> list[int]:
        return self._new_grid.overlapping(self.old[j][0])

    def old_of_new(self, k: int) -> list[int]:
        return self._old_grid.overlapping(self.new[k][0])

    def from_old_box(self, j: int) -> list[Transfer]:
        """Every piece taken out of old box `j`: local copies and network transfers."""
        box, holders = self.old[j]
        held = set(holders)
        out: list[Transfer] = []
        pending: dict[int, list[Box]] = defaultdict(list)
        for k in self.new_of_old(j):
            new_box, needers = self.new[k]
            piece = intersect(box, new_box)
            assert piece is not None
            for member in needers:
                if member in held:
                    out.append(Transfer(member, member, piece))
                else:
                    pending[member].append(piece)
        if pending and not holders:
            raise LostPiece(box)
        # Round-robin over holders, offset by the box's ordinal so no holder is always first.
        for i, member in enumerate(sorted(pending)):
            src = holders[(j + i) % len(holders)]
            out += [Transfer(src, member, piece) for piece in pending[member]]
        return out

    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for j in range(len(self.old)) for t in self.from_old_box(j))

    def transfers_of(
        self, member: int, old_boxes: list[int], new_boxes: list[int]
    ) -> list[Transfer]:
        """The pieces `member` sends or receives, given the old boxes it holds and the new boxes it
        needs (indices into the partitions), without computing other old boxes' pieces."""
        sources = set(old_boxes)
        for k in new_boxes:
            sources.update(self.old_of_new(k))
        return [
            t for j in sorted(sources) for t in self.from_old_box(j) if member in (t.src, t.dst)
        ]
