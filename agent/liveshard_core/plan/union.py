"""The union of a change's old and new members, and layout partitions numbered by slot.

A plan names members by *slot*: the old members in old rank order, then the members only the new
layout has, in new rank order. Members that died with their state (`lost`) take no slot.
"""

from __future__ import annotations

from ..errors import InvalidInput
from ..layout.layout import Layout
from ..layout.region import Placed, partition
from .matching import Matching, Partition


def union_members(old: Layout, new: Layout, lost: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Old members in old rank order, then the members only the new layout has; members that
    are `lost` (died with their state) take no part."""
    present = set(old.members)
    return tuple(m for m in old.members if m not in lost) + tuple(
        m for m in new.members if m not in present
    )


def check_change(old: Layout, new: Layout, lost: frozenset[str]) -> None:
    """Raise ValueError when `lost` names members the change cannot lose."""
    unknown = sorted(lost - set(old.members))
    if unknown:
        raise InvalidInput(f"lost members {unknown} are not members of the old layout")
    back = sorted(lost & set(new.members))
    if back:
        raise InvalidInput(f"lost members {back} cannot be members of the new layout")


class Partitions:
    """Partitions of the old and new layout with holders as slots, computed once per placement,
    and the matchings between them."""

    def __init__(self, old: Layout, new: Layout, union: tuple[str, ...]) -> None:
        self.old_layout, self.new_layout = old, new
        slot = {m: i for i, m in enumerate(union)}
        self.new_to_union = [slot[m] for m in new.members]
        # Old ranks are slots unless members were lost; then lost holders drop out.
        self.old_to_union = [slot.get(m) for m in old.members]
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
