"""Matching one class of tensors: which holder sends which piece to which destination.

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

Slot = int
"""A member's position in a plan's union: the old members in old rank order, then the members
only the new layout has (see `plan.union`). Plans name members by slot, layouts by rank."""


class Piece(NamedTuple):
    """One box of one logical tensor moving from slot `src` to slot `dst`; `src == dst` is a
    local copy, anything else crosses the network."""

    src: Slot
    dst: Slot
    box: Box


Partition = list[tuple[Box, tuple[int, ...]]]


class LostPiece(Exception):
    """A needed piece whose every holder is lost."""

    def __init__(self, box: Box) -> None:
        super().__init__(box)
        self.box = box


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


class Matching:
    """The pieces of one tensor class between an old and a new partition (holders as slots).

    Overlaps are looked up on demand, so one member's part costs only the boxes it touches.
    """

    def __init__(self, old: Partition, new: Partition) -> None:
        self.old = old
        self.new = new
        self._old_grid = BoxGrid([box for box, _ in old])
        self._new_grid = BoxGrid([box for box, _ in new])

    def new_of_old(self, j: int) -> list[int]:
        return self._new_grid.overlapping(self.old[j][0])

    def old_of_new(self, k: int) -> list[int]:
        return self._old_grid.overlapping(self.new[k][0])

    def from_old_box(self, j: int) -> list[Piece]:
        """Every piece taken out of old box `j`: local copies and network pieces."""
        box, holders = self.old[j]
        held = set(holders)
        out: list[Piece] = []
        pending: dict[Slot, list[Box]] = defaultdict(list)
        for k in self.new_of_old(j):
            new_box, needers = self.new[k]
            overlap = intersect(box, new_box)
            assert overlap is not None
            for slot in needers:
                if slot in held:
                    out.append(Piece(slot, slot, overlap))
                else:
                    pending[slot].append(overlap)
        if pending and not holders:
            raise LostPiece(box)
        # Round-robin over holders, offset by the box's ordinal so no holder is always first.
        for i, slot in enumerate(sorted(pending)):
            src = holders[(j + i) % len(holders)]
            out += [Piece(src, slot, overlap) for overlap in pending[slot]]
        return out

    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for j in range(len(self.old)) for p in self.from_old_box(j))

    def pieces_of(self, slot: Slot, old_boxes: list[int], new_boxes: list[int]) -> list[Piece]:
        """The pieces `slot` sends or receives, given the old boxes it holds and the new boxes it
        needs (indices into the partitions), without computing other old boxes' pieces."""
        sources = set(old_boxes)
        for k in new_boxes:
            sources.update(self.old_of_new(k))
        return [p for j in sorted(sources) for p in self.from_old_box(j) if slot in (p.src, p.dst)]
