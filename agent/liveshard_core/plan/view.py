"""One member's part of a plan, computed from what the member holds and needs only.

An agent needs only its own local copies, sends and receives. `member_plan` finds them class by
class (`matching.member_pieces`): the partitions are looked up by arithmetic, so the work follows
the member's own pieces and the number of tensor classes, not the number of ranks. The patterns
are numbered as in the whole plan (`plan.build_plan`), so a member's part and its loads line up
with everyone else's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..errors import InvalidInput
from ..layout.layout import Layout
from ..layout.region import Placed
from ..vps.spec import ModelSpec, TensorRef
from .classes import TensorClass, tensor_classes
from .matching import Piece, Slot, member_pieces
from .plan import lost_tensor, source_layout
from .schedule import Position, member_position
from .union import Pods, Union


@dataclass(frozen=True)
class MemberPlan:
    """A member's pieces of every pattern of a plan (its local copies, sends and receives)."""

    spec: ModelSpec
    old: Layout
    new: Layout
    member: str
    slot: Slot
    position: Position  # where it is in both layouts (`schedule.member_position`)
    members: int  # the size of the union
    patterns: tuple[tuple[Piece, ...], ...]  # numbered as Plan.patterns
    groups: tuple[tuple[int, TensorClass], ...]  # (pattern, class), as Plan.groups

    @cached_property
    def network(self) -> tuple[tuple[Piece, ...], ...]:
        """The member's network pieces of each pattern."""
        return tuple(tuple(p for p in ps if p.src != p.dst) for ps in self.patterns)

    def expanded(self) -> tuple[list[tuple[TensorRef, Piece]], ...]:
        """(local copies, sends, receives), each as (tensor, piece) in plan order."""
        local: list[tuple[TensorRef, Piece]] = []
        sends: list[tuple[TensorRef, Piece]] = []
        recvs: list[tuple[TensorRef, Piece]] = []
        for pattern, cls in self.groups:
            for p in self.patterns[pattern]:
                bucket = local if p.src == p.dst else sends if p.src == self.slot else recvs
                bucket += [(ref, p) for ref in cls.tensors]
        return local, sends, recvs


def member_plan(
    spec: ModelSpec,
    old: Layout,
    new: Layout,
    member: str,
    lost: frozenset[str] = frozenset(),
    union: Union | None = None,
) -> MemberPlan:
    """`member`'s part of the plan from `old` to `new`. `union` (built once per change, one pass
    over the member lists, with the change's pods) may be shared by several calls."""
    old.check(spec)
    new.check(spec)
    union = union or Union(old, new, lost)
    slot = union.slot_of(member)
    old_rank = old.ranks.get(member) if member not in lost else None
    new_rank = new.ranks.get(member)
    index: dict[tuple[Placed, Placed], int] = {}
    patterns: list[tuple[Piece, ...]] = []
    groups = []
    source = source_layout(old, lost)
    for cls in tensor_classes(spec, source, new):
        key = (cls.old, cls.new)
        if key not in index:
            index[key] = len(patterns)
            with lost_tensor(spec, cls, lost, source is not old):
                pieces = member_pieces(union, cls.old, cls.new, old_rank, new_rank)
            patterns.append(tuple(pieces))
        groups.append((index[key], cls))
    position = member_position(old, new, old_rank, new_rank)
    return MemberPlan(
        spec, old, new, member, slot, position, len(union.members), tuple(patterns), tuple(groups)
    )


@dataclass(frozen=True)
class PlanView:
    """One member's part of a plan: what it copies locally, sends and receives."""

    part: MemberPlan
    local: tuple[tuple[TensorRef, Piece], ...]
    sends: tuple[tuple[TensorRef, Piece], ...]
    recvs: tuple[tuple[TensorRef, Piece], ...]


def plan_view(
    spec: ModelSpec,
    old: Layout,
    new: Layout,
    member: str,
    lost: frozenset[str] = frozenset(),
    pods: Pods | None = None,
) -> PlanView:
    """`member`'s part of the plan (taking bytes inside `pods` first), expanded to (tensor,
    piece) lists."""
    if member in lost:
        raise InvalidInput(f"member {member!r} is lost and takes no part in the plan")
    part = member_plan(spec, old, new, member, lost, Union(old, new, lost, pods))
    local, sends, recvs = part.expanded()
    return PlanView(part, tuple(local), tuple(sends), tuple(recvs))
