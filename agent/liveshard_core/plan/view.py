"""One member's part of a plan, computed from the classes it takes part in only.

An agent needs only its own local copies, sends and receives; `plan_view` finds them by looking
up the old boxes the member holds and the new boxes it needs, without the other members' pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInput
from ..layout.layout import Layout
from ..layout.region import Placed, rank_boxes
from ..vps.spec import ModelSpec, TensorRef
from .classes import tensor_classes
from .matching import Piece, Slot
from .union import Partitions, check_change, union_members


@dataclass(frozen=True)
class PlanView:
    """One member's part of a plan: what it copies locally, sends and receives."""

    member: str
    slot: Slot
    local: tuple[tuple[TensorRef, Piece], ...]
    sends: tuple[tuple[TensorRef, Piece], ...]
    recvs: tuple[tuple[TensorRef, Piece], ...]


def plan_view(
    spec: ModelSpec, old: Layout, new: Layout, member: str, lost: frozenset[str] = frozenset()
) -> PlanView:
    """`member`'s part of the plan, computed from the classes it takes part in only."""
    old.check(spec)
    new.check(spec)
    check_change(old, new, lost)
    members = union_members(old, new, lost)
    if member not in members:
        raise InvalidInput(f"member {member!r} is a live member of neither layout")
    slot = members.index(member)
    old_rank = old.rank_of(member) if member in old.members else None
    new_rank = new.rank_of(member) if member in new.members else None
    parts = Partitions(old, new, members)
    cache: dict[tuple[Placed, Placed], list[Piece]] = {}
    local: list[tuple[TensorRef, Piece]] = []
    sends: list[tuple[TensorRef, Piece]] = []
    recvs: list[tuple[TensorRef, Piece]] = []
    for cls in tensor_classes(spec, old, new):
        key = (cls.old, cls.new)
        if key not in cache:
            cache[key] = _slot_pieces(parts, cls.old, cls.new, old_rank, new_rank, slot)
        for p in cache[key]:
            bucket = local if p.src == p.dst else sends if p.src == slot else recvs
            bucket += [(ref, p) for ref in cls.tensors]
    return PlanView(member, slot, tuple(local), tuple(sends), tuple(recvs))


def _slot_pieces(
    parts: Partitions,
    placed_old: Placed,
    placed_new: Placed,
    old_rank: int | None,
    new_rank: int | None,
    slot: Slot,
) -> list[Piece]:
    held = [] if old_rank is None else rank_boxes(parts.old_layout, placed_old, old_rank)
    needed = [] if new_rank is None else rank_boxes(parts.new_layout, placed_new, new_rank)
    if not held and not needed:
        return []
    matching = parts.matching(placed_old, placed_new)
    old_index = {box: j for j, (box, _) in enumerate(matching.old)}
    new_index = {box: k for k, (box, _) in enumerate(matching.new)}
    return matching.pieces_of(slot, [old_index[b] for b in held], [new_index[b] for b in needed])
