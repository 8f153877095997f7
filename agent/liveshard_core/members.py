"""Member changes: which members leave, die, are replaced or join when a job changes layout.

Members of a change are numbered by their rank in the old layout (`"0"`, `"1"`, ...), and new
members after the old ones. A `MemberChange` says what happens to them:
- `drop`: members that leave; the remaining ones take the new layout's ranks from 0 in order;
- `replace`: members whose rank a new member takes (a replaced pod keeps its neighbours in place);
- `lost`: members that died with their state; they leave like dropped ones (unless also replaced),
  and the plan takes every byte from surviving copies;
- `add`: how many new members join, appended after the remaining ones; by default as many as the
  new layout still needs.

Which survivor takes which new rank is the *assignment* (`Assign`):
- `ORDERED`: the remaining members, in order, take the new layout's ranks from 0 (a replaced
  member's rank goes to its replacement); with neither `drop` nor `replace`, a new layout smaller
  than the remaining members leaves out the highest-numbered ones; with either, surplus members
  are an error;
- `BEST` (the default of `liveshard plan`): the assignment with the fewest network bytes
  (`assign`), ties broken by the busiest receiver; survivors that no rank needs stay as spares.
  When the in-order assignment (surplus survivors cut from the end) is as good on both counts,
  it is the one taken, so members change places only when that moves fewer bytes. Replaced
  members leave, and their replacements join like added members. Members in pods of several
  (`per_pod`, numbered in order: `numbered_pods`) fill each tensor-parallel group of a new layout
  with tp > 1 from one pod, as the operator places them: the pod-aligned groups that keep the
  most bytes (`assign.grouped_members`), when the pods hold enough whole groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from .assign.assign import Assignment, Problem, pod_grouped_members
from .errors import InvalidInput
from .layout.layout import Degrees, Layout
from .plan.plan import source_layout
from .vps.spec import ModelSpec


class Assign(Enum):
    """How survivors take the new layout's ranks (module docstring)."""

    BEST = "best"
    ORDERED = "ordered"


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
    _check_numbers(old, change)
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


@dataclass(frozen=True)
class Change:
    """A member change resolved into layouts, with the figures of both assignments."""

    old: Layout
    new: Layout
    assign: Assign
    chosen: Assignment  # the assignment `new` follows
    best: Assignment
    ordered: Assignment  # the in-order assignment, surplus survivors (the last ones) as spares

    @property
    def spares(self) -> tuple[int, ...]:
        return self.chosen.spares


def resolve_change(
    spec: ModelSpec,
    old_degrees: Degrees,
    new_degrees: Degrees,
    change: MemberChange,
    assign: Assign = Assign.BEST,
    per_pod: int = 1,
) -> Change:
    """The old and new layout of `change` under `assign` (members `per_pod` to a pod), and both
    assignments' figures."""
    if assign is Assign.ORDERED:
        old, new = apply_change(spec, old_degrees, new_degrees, change)
    else:
        old = old_degrees.layout(spec, old_members(old_degrees.world_size))
        _check_numbers(old, change)
    leaving = {*change.drop, *change.lost, *change.replace}
    survivors = [i for i in range(old.world_size) if i not in leaving]
    need = new_degrees.world_size
    joiners = len(change.replace) + (
        change.add
        if change.add is not None
        else max(need - len(survivors) - len(change.replace), 0)
    )
    # What the survivors hold as the plan reads it (a recovery from ZeRO-1: parameters from
    # their shard's holders only), so that the assignment's bytes are the plan's.
    source = source_layout(old, change.lost_members())
    problem = Problem(spec, source, new_degrees)
    ordered = problem.given(_in_order(old, change, need, joiners), survivors)
    best = problem.best(survivors, joiners)
    if assign is Assign.ORDERED:
        chosen = problem.given([int(m) if m in old.ranks else None for m in new.members], survivors)
        return Change(old, new, assign, chosen, best, ordered)
    in_pods = _in_pods(spec, source, new_degrees, survivors, joiners, per_pod)
    if in_pods is not None:
        chosen = problem.given([int(m) if m in old.ranks else None for m in in_pods], survivors)
        return Change(old, new_degrees.layout(spec, in_pods), assign, chosen, best, ordered)
    # The in-order assignment, when it is as good, is kept: fewer members change places.
    as_good = (ordered.network_bytes, ordered.max_recv_bytes) <= (
        best.network_bytes, best.max_recv_bytes,
    )  # fmt: skip
    chosen = ordered if as_good else best
    fresh = (str(n) for n in itertools.count(old.world_size))
    members = [str(m) if m is not None else next(fresh) for m in chosen.members_to]
    return Change(old, new_degrees.layout(spec, members), assign, chosen, best, ordered)


def _in_pods(
    spec: ModelSpec, old: Layout, degrees: Degrees, survivors: list[int], joiners: int,
    per_pod: int,
) -> list[str] | None:  # fmt: skip
    """The members of `degrees`' layout in rank order with each tensor-parallel group from one
    pod (`per_pod` members to a pod by number, joiners numbered after the old members): None
    without pods or tp, or when the pods hold too few whole groups."""
    fresh = range(old.world_size, old.world_size + joiners)
    members = [*(old.members[i] for i in survivors), *(str(n) for n in fresh)]
    return pod_grouped_members(spec, old, degrees, members, numbered_pods(members, per_pod))


def numbered_pods(members: Iterable[str], per_pod: int) -> dict[str, str]:
    """Each member's pod, `per_pod` members to a pod in member number order (none for 1)."""
    if per_pod < 1:
        raise InvalidInput(f"--members-per-pod {per_pod} must be at least 1")
    if per_pod == 1:
        return {}
    return {m: f"pod-{int(m) // per_pod}" for m in members}


def _check_numbers(old: Layout, change: MemberChange) -> None:
    for field, numbers in (("drop", change.drop), ("replace", change.replace),
                           ("lost", change.lost)):  # fmt: skip
        bad = sorted({n for n in numbers if not 0 <= n < old.world_size})
        if bad:
            raise InvalidInput(f"--{field} {bad}: members are numbered 0..{old.world_size - 1}")


def _in_order(old: Layout, change: MemberChange, need: int, joiners: int) -> list[int | None]:
    """The in-order assignment: remaining members in order, a replacement in its member's
    rank, surplus survivors cut from the end, then the other joiners."""
    leaving = {*change.drop, *(n for n in change.lost if n not in change.replace)}
    staying: list[int | None] = [
        None if i in change.replace else i for i in range(old.world_size) if i not in leaving
    ]
    extra = joiners - len(change.replace)
    kept = need - extra
    # Cut surplus survivors from the end, keeping every replacement's rank.
    while len(staying) > kept:
        last = max(i for i, m in enumerate(staying) if m is not None)
        staying.pop(last)
    return [*staying, *([None] * (need - len(staying)))]
