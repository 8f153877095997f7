"""Plans for real model shapes on 1000+ ranks (DESIGN.md section 9): invariants, not timing.

Brute force over every logical tensor is out of reach at this size, so the checks work per tensor
class (tensors placed alike share their pieces, so checking a class checks all its tensors):
every piece comes from a member that held it, every new rank receives or copies exactly the bytes
of its region, network bytes equal the independently computed lower bound, one member's view is
its part of the whole plan, and the schedule keeps every member within the budget.
"""

from __future__ import annotations

from collections import Counter

import pytest

from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.layout.region import rank_boxes
from liveshard_core.plan.bounds import lower_bound_bytes
from liveshard_core.plan.plan import Plan, build_plan
from liveshard_core.plan.schedule import build_schedule
from liveshard_core.plan.view import plan_view
from liveshard_core.vps.box import volume
from liveshard_core.vps.presets import preset
from tests.core.helpers import inside
from tests.helpers import names

CASES = {
    # 1024 -> 960 ranks: one node of 64 ranks leaves, pp 8 -> 4.
    "llama-70b": ("tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1"),
    # 1024 -> 768 ranks with experts across ep=8.
    "qwen3-235b-a22b": ("tp=4,pp=8,dp=32,ep=8,zero=1", "tp=4,pp=8,dp=24,ep=8,zero=1"),
}


def layouts(model: str) -> tuple[Layout, Layout]:
    spec = preset(model)
    old_text, new_text = CASES[model]
    old_degrees, new_degrees = parse_degrees(old_text), parse_degrees(new_text)
    old = old_degrees.layout(spec, names(old_degrees.world_size))
    return old, new_degrees.layout(spec, list(old.members[: new_degrees.world_size]))


def check_sources_held_their_pieces(plan: Plan) -> None:
    for group in plan.groups:
        cls = group.tensors
        for piece in plan.pattern_of(group).network:
            src_rank = plan.old.rank_of(plan.members[piece.src])
            held = rank_boxes(plan.old, cls.old, src_rank)
            assert any(inside(piece.box, box) for box in held), (cls.params[0], piece)


def check_every_rank_gets_its_region(plan: Plan) -> None:
    needed: Counter[int] = Counter()
    got: Counter[int] = Counter()
    _, recvs = plan.slot_bytes
    for group in plan.groups:
        cls = group.tensors
        per_tensor = group.itemsize * len(cls)
        for rank in range(plan.new.world_size):
            slot = plan.slot_of(plan.new.members[rank])
            needed[slot] += sum(map(volume, rank_boxes(plan.new, cls.new, rank))) * per_tensor
        for slot, pieces in plan.pattern_of(group).local_by_slot.items():
            got[slot] += sum(volume(p.box) for p in pieces) * per_tensor
    for slot, n in recvs.items():
        got[slot] += n
    assert got == needed


@pytest.mark.parametrize("model", list(CASES))
def test_large_plan_invariants(model: str) -> None:
    spec = preset(model)
    old, new = layouts(model)
    assert old.world_size == 1024 and new.world_size >= 768
    plan = build_plan(spec, old, new)
    assert plan.network_bytes == lower_bound_bytes(spec, old, new) > 0
    check_sources_held_their_pieces(plan)
    check_every_rank_gets_its_region(plan)
    assert build_plan(spec, old, new).digest == plan.digest
    # One member's view is its part of the whole plan (a leaver, a stayer and the last rank).
    for member in (old.members[5], old.members[-1], new.members[-1]):
        view = plan_view(spec, old, new, member)
        slot = plan.slot_of(member)
        sends, recvs = plan.slot_bytes
        view_sends = sum(volume(p.box) * spec.dtype(ref.kind).itemsize for ref, p in view.sends)
        view_recvs = sum(volume(p.box) * spec.dtype(ref.kind).itemsize for ref, p in view.recvs)
        assert (view_sends, view_recvs) == (sends.get(slot, 0), recvs.get(slot, 0)), member
        assert len(view.local) == len(plan.local_copies(slot))
    budget = 1 << 30
    schedule = build_schedule(plan, budget)
    assert max(max(r.values()) for r in schedule.round_bytes()) <= budget
