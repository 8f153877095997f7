"""Member changes: which members leave, die, are replaced or join when a job changes layout.

Members of a change are numbered by their rank in the old layout (`"0"`, `"1"`, ...), and new
members after the old ones. A `MemberChange` says what happens to them:
- `drop`: members that leave; the remaining ones take the new layout's ranks from 0 in order;
- `replace`: members whose rank a new member takes (a replaced pod keeps its neighbours in place);
- `lost`: members that died with their state; they leave like dropped ones (unless also replaced),
  and the plan takes every byte from surviving copies;
- `add`: how many new members join, appended after the remaining ones; by default as many as the
  new layout still needs.
With neither `drop` nor `replace`, a new layout smaller than the remaining members drops the
highest-numbered ones; with either, surplus members are an error.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .errors import InvalidInput
from .layout.layout import Degrees, Layout
from .vps.spec import ModelSpec


@dataclass(frozen=True)
class MemberChange:
    """What happens to the old layout's members (by number) in a change."""

    drop: tuple[int, ...] = ()
    replace: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    add: int | None = None

    def __post_init__(self) -> None:
        if self.add is not None and self.add < 0:
            raise InvalidInput(f"--add {self.add} must be >= 0")
        both = sorted(set(self.drop) & set(self.replace))
        if both:
            raise InvalidInput(f"members {both} are both dropped and replaced")

    def lost_members(self) -> frozenset[str]:
        return frozenset(str(n) for n in self.lost)


def old_members(count: int) -> list[str]:
    """The member names of an old layout of `count` ranks: its rank numbers."""
    return [str(i) for i in range(count)]


def apply_change(
    spec: ModelSpec, old_degrees: Degrees, new_degrees: Degrees, change: MemberChange
) -> tuple[Layout, Layout]:
    """The old and new layout with members numbered as the module docstring says."""
    old = old_degrees.layout(spec, old_members(old_degrees.world_size))
    for field, numbers in (("drop", change.drop), ("replace", change.replace),
                           ("lost", change.lost)):  # fmt: skip
        bad = sorted({n for n in numbers if not 0 <= n < old.world_size})
        if bad:
            raise InvalidInput(f"--{field} {bad}: members are numbered 0..{old.world_size - 1}")
    # A lost member may also be replaced; otherwise it leaves like a dropped one.
    leaving = {*change.drop, *(n for n in change.lost if n not in change.replace)}
    fresh = (str(n) for n in itertools.count(old.world_size))
    staying = [
        next(fresh) if i in change.replace else m
        for i, m in enumerate(old.members)
        if i not in leaving
    ]
    need = new_degrees.world_size
    add = change.add
    if add is None:
        add = max(need - len(staying), 0)
        if not change.drop and not change.replace:
            staying = staying[:need]
    if len(staying) + add != need:
        raise InvalidInput(
            f"{len(staying)} remaining members + {add} added != {need} ranks of the new layout"
        )
    return old, new_degrees.layout(spec, staying + [next(fresh) for _ in range(add)])
