"""The union of a change's old and new members, numbered by slot, and its partitions.

A plan names members by *slot*: the old members in old rank order, then the members only the new
layout has, in new rank order. Members that died with their state (`lost`) take no slot.
`Union` also keeps each placement's partition (`region.Geometry`) and what the whole plan derives
from two of them: the overlapping boxes by cells, and every cell's holders as slots; and, where
members share pods (`Pods`: each member's pod; a member it does not name shares none), which live
holders of a box are in a member's own pod (`near`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from itertools import filterfalse

from ..errors import InvalidInput
from ..layout.layout import Layout
from ..layout.region import Cell, Geometry, Holders, Placed
from ..vps.box import Box, intersect
from .matching import Slot


def union_members(old: Layout, new: Layout, lost: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Old members in old rank order, then the members only the new layout has; members that
    are `lost` (died with their state) take no part."""
    kept = tuple(filterfalse(lost.__contains__, old.members)) if lost else old.members
    return kept + tuple(filterfalse(old.ranks.__contains__, new.members))


def check_change(old: Layout, new: Layout, lost: frozenset[str]) -> None:
    """Raise ValueError when `lost` names members the change cannot lose."""
    unknown = sorted(m for m in lost if m not in old.ranks)
    if unknown:
        raise InvalidInput(f"lost members {unknown} are not members of the old layout")
    back = sorted(m for m in lost if m in new.ranks)
    if back:
        raise InvalidInput(f"lost members {back} cannot be members of the new layout")


Pair = tuple[Cell, Cell, list[tuple[int, int, Box]]]
"""An old cell, a new cell, and the overlaps of their boxes: (old ordinal, new ordinal, box)."""


CellSlots = dict[Cell, list[Slot]]

Pods = Mapping[str, str]
"""Each member's pod, for members that share one with others (the devices of one machine)."""


class Sources:
    """The live holders of one old box (its holders less the lost ones), as slots."""

    def __init__(self, union: Union, holders: Holders) -> None:
        self.union, self.holders = union, holders
        # Positions among the holders of the lost ones: few, so one pass over them.
        self.lost = sorted(
            i for r in union.lost_ranks if (i := holders.index(r)) is not None
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.holders) - len(self.lost)

    def slot(self, x: int) -> Slot:
        """The x-th live holder's slot."""
        for i in self.lost:
            if i > x:
                break
            x += 1
        slot = self.union.old_slot(self.holders.rank(x))
        assert slot is not None
        return slot

    def position(self, rank: int) -> int:
        """The position of live holder `rank` among the live holders."""
        i = self.holders.index(rank)
        assert i is not None
        return i - bisect_left(self.lost, i)


class Union:
    """The members of a change, by slot, and the geometry of its placements (computed once
    each). Building it costs one pass over the member lists; everything else it answers costs
    what the answer holds."""

    def __init__(
        self, old: Layout, new: Layout, lost: frozenset[str] = frozenset(), pods: Pods | None = None
    ) -> None:
        check_change(old, new, lost)
        self.old, self.new, self.lost = old, new, lost
        self.members = union_members(old, new, lost)
        self.slots = dict(zip(self.members, range(len(self.members)), strict=True))
        self.lost_ranks = sorted(old.ranks[m] for m in lost)
        # Each slot's pod (None: it shares none), and each pod's members by old and new rank.
        self.pods: list[str | None] | None = None
        self._pod_ranks: dict[str, list[int]] = {}
        self._pod_new_ranks: dict[str, list[int]] = {}
        if pods:
            self.pods = [pods.get(m) for m in self.members]
            for member, pod in zip(self.members, self.pods, strict=True):
                if pod is not None and member in old.ranks:
                    self._pod_ranks.setdefault(pod, []).append(old.ranks[member])
            for rank, member in enumerate(new.members):
                if (pod := pods.get(member)) is not None:
                    self._pod_new_ranks.setdefault(pod, []).append(rank)
        self._old: dict[Placed, Geometry] = {}
        self._new: dict[Placed, Geometry] = {}
        self._sources: dict[Holders, Sources] = {}
        self._pairs: dict[tuple[Placed, Placed], list[Pair]] = {}
        self._cell_slots: dict[Geometry, CellSlots] = {}

    def slot_of(self, member: str) -> Slot:
        try:
            return self.slots[member]
        except KeyError:
            raise InvalidInput(f"member {member!r} is a live member of neither layout") from None

    def old_slot(self, rank: int) -> Slot | None:
        """The slot of the member at old rank `rank`; None when it is lost."""
        return self.slots.get(self.old.members[rank])

    def new_slot(self, rank: int) -> Slot:
        return self.slots[self.new.members[rank]]

    def old_rank_of_new(self, rank: int) -> int | None:
        """The old rank of the member at new rank `rank`; None when it is new."""
        return self.old.ranks.get(self.new.members[rank])

    def near(self, slot: Slot, holders: Holders) -> list[Slot]:
        """The live holders among `holders` that share `slot`'s pod, in old rank order (which
        the slots of old members follow)."""
        pod = self.pod_of(slot)
        ranks = self._pod_ranks.get(pod, []) if pod is not None else []
        return [self.slots[self.old.members[r]] for r in ranks if holders.index(r) is not None]

    def pod_of(self, slot: Slot) -> str | None:
        return self.pods[slot] if self.pods is not None else None

    def pod_new_ranks(self, slot: Slot) -> list[int]:
        """The new ranks of the members of `slot`'s pod (none when it shares none)."""
        pod = self.pod_of(slot)
        return self._pod_new_ranks.get(pod, []) if pod is not None else []

    def near_by_pod(self, sources: list[Slot]) -> dict[str, list[Slot]]:
        """`sources` (a cell's live holders) grouped by their pod, each group in slot order."""
        out: dict[str, list[Slot]] = {}
        if self.pods is not None:
            for s in sources:
                pod = self.pods[s]
                if pod is not None:
                    out.setdefault(pod, []).append(s)
        return out

    def old_geometry(self, placed: Placed) -> Geometry:
        if placed not in self._old:
            self._old[placed] = Geometry(self.old, placed)
        return self._old[placed]

    def new_geometry(self, placed: Placed) -> Geometry:
        if placed not in self._new:
            self._new[placed] = Geometry(self.new, placed)
        return self._new[placed]

    def sources(self, holders: Holders) -> Sources:
        if holders not in self._sources:
            self._sources[holders] = Sources(self, holders)
        return self._sources[holders]

    def cell_slots(self, old: Geometry, new: Geometry) -> tuple[CellSlots, CellSlots]:
        """For every cell of `old`, its live holders' slots; for every cell of `new`, its
        holders' slots (computed once per geometry)."""
        if old not in self._cell_slots:
            old_slot = self.old_slot
            self._cell_slots[old] = {
                # Without lost members, an old rank is its slot.
                cell: [s for r in ranks if (s := old_slot(r)) is not None] if self.lost
                else list(ranks)
                for cell, ranks in old.cell_ranks().items()
            }  # fmt: skip
        if new not in self._cell_slots:
            slot = self._new_slots.__getitem__
            self._cell_slots[new] = {
                cell: list(map(slot, ranks)) for cell, ranks in new.cell_ranks().items()
            }
        return self._cell_slots[old], self._cell_slots[new]

    @cached_property
    def _new_slots(self) -> list[Slot]:
        return list(map(self.slots.__getitem__, self.new.members))

    def pairs(self, old: Placed, new: Placed) -> list[Pair]:
        """Every overlap of an old and a new box of a class, by cells, in the plan's order. The
        boxes do not depend on the stages that hold them: classes that differ only in stages
        share these."""
        key = (replace(old, stages=()), replace(new, stages=()))
        if key not in self._pairs:
            old_geometry, new_geometry = self.old_geometry(old), self.new_geometry(new)
            pairs: list[Pair] = []
            for old_cell in old_geometry.cells():
                found: dict[Cell, list[tuple[int, int, Box]]] = {}
                for j, box in old_geometry.boxes(old_cell):
                    for new_cell in new_geometry.cells_overlapping(box):
                        for k, new_box in new_geometry.boxes(new_cell):
                            part = intersect(box, new_box)
                            if part is not None:
                                found.setdefault(new_cell, []).append((j, k, part))
                pairs += [(old_cell, cell, sorted(found[cell])) for cell in sorted(found)]
            self._pairs[key] = pairs
        return self._pairs[key]
