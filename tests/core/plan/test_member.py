"""A member's own part and schedule, computed alone, equal its part of the whole plan's.

`member_plan` walks the partitions by arithmetic and `member_schedule` cuts rounds from the plan's
traffic (every member's own traffic, united); both must give exactly what the whole plan and its
schedule give that member, in the same order (the order is what pairs sends with receives).
"""

from __future__ import annotations

from functools import reduce

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout
from liveshard_core.layout.region import region
from liveshard_core.plan.plan import Plan, build_plan, source_layout
from liveshard_core.plan.schedule import (
    Traffic,
    build_schedule,
    member_schedule,
    member_traffic,
    plan_traffic,
)
from liveshard_core.plan.union import Union
from liveshard_core.plan.view import MemberPlan, member_plan
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec
from tests.core.helpers import Case, cases, check_plan, inside
from tests.core.plan.test_large import layouts
from tests.core.plan.test_schedule import min_budget
from tests.helpers import names


def parts(spec: ModelSpec, plan: Plan, members: list[str] | None = None) -> list[MemberPlan]:
    union = Union(plan.old, plan.new, plan.lost, plan.pods)
    chosen = plan.members if members is None else members
    return [member_plan(spec, plan.old, plan.new, m, plan.lost, union) for m in chosen]


def check_part(plan: Plan, part: MemberPlan) -> None:
    slot = plan.slot_of(part.member)
    assert part.slot == slot
    assert len(part.patterns) == len(plan.patterns)
    for mine, pattern in zip(part.patterns, plan.patterns, strict=True):
        assert list(mine) == [p for p in pattern.pieces if slot in (p.src, p.dst)]
    assert [cls for _, cls in part.groups] == [g.tensors for g in plan.groups]
    assert [pattern for pattern, _ in part.groups] == [g.pattern for g in plan.groups]


def check_schedules(plan: Plan, members: list[MemberPlan], budget: int) -> None:
    whole = build_schedule(plan, budget)
    traffic = plan_traffic(plan)
    for part in members:
        own = member_schedule(part, traffic, budget)
        assert own.rounds == whole.rounds
        assert own.chunk_rows == whole.chunk_rows
        assert own.slot_rounds(part.slot) == whole.slot_rounds(part.slot)
        assert own.local_copies(part.slot) == whole.local_copies(part.slot)


def check_inside_pods(spec: ModelSpec, plan: Plan) -> None:
    """Every piece a member takes from another comes from its own pod when a live member of its
    pod held it (by brute force over the old regions)."""
    source = source_layout(plan.old, plan.lost)
    for ref, _, piece in plan.items():
        if piece.src == piece.dst or plan.members[piece.dst] not in plan.pods:
            continue
        pod = plan.pods[plan.members[piece.dst]]
        near = [
            m for m in plan.members
            if plan.pods.get(m) == pod and m in source.ranks
            and any(inside(piece.box, b) for b in region(spec, source, source.ranks[m], ref))
        ]  # fmt: skip
        assert not near or plan.members[piece.src] in near, (ref, piece, near)


@st.composite
def lost_cases(draw: st.DrawFn) -> tuple[Case, frozenset[str], dict[str, str]]:
    """A change, some old members that leave it lost (died with their state), and the pods
    some of its members share (none, or up to three pods)."""
    case = draw(cases(max_world=6))
    leaving = [m for m in case.old.members if m not in case.new.members]
    lost = draw(st.lists(st.sampled_from(leaving), unique=True)) if leaving else []
    members = sorted(set(case.old.members) | set(case.new.members))
    where = st.one_of(st.none(), st.sampled_from(["p0", "p1", "p2"]))
    pods = draw(st.one_of(st.just({}), st.fixed_dictionaries({m: where for m in members})))
    return case, frozenset(lost), {m: pod for m, pod in pods.items() if pod is not None}


@settings(max_examples=80, deadline=None)
@given(lost_cases(), st.data())
def test_member_part_and_schedule_equal_the_whole(
    drawn: tuple[Case, frozenset[str], dict[str, str]], data: st.DataObject
) -> None:
    case, lost, pods = drawn
    try:
        plan = build_plan(case.spec, case.old, case.new, lost, pods)
    except InvalidInput:
        assume(False)  # a lost box without copies: no plan at all
        raise
    check_plan(case.spec, case.old, case.new, plan, lost)  # pods change sources, not bytes
    check_inside_pods(case.spec, plan)
    members = parts(case.spec, plan)
    for part in members:
        check_part(plan, part)
    # The plan's traffic is every member's own, united, also through the all-reduced vector.
    united = reduce(Traffic.__or__, (member_traffic(p) for p in members))
    assert united == plan_traffic(plan)
    vectors = [member_traffic(p).vector() for p in members]
    maxima = [max(column) for column in zip(*vectors, strict=True)]
    assert united.from_vector(maxima) == united
    low = min_budget(plan)
    budget = data.draw(st.one_of(st.just(low), st.integers(low, 64 * low)), label="budget")
    check_schedules(plan, members, budget)


def test_member_parts_with_lost_members() -> None:
    # tiny-moe without ZeRO: every member of an ep group holds its experts whole, so losing one
    # member of each pair leaves a copy of everything; the survivors regroup as tp=2.
    moe = preset("tiny-moe")
    old = Layout.create(moe, names(8), dp=4, pp=2, ep=2)
    new = Layout.create(moe, ["m0", "m1", "m6", "n0"], dp=2, tp=2)
    plan = build_plan(moe, old, new, frozenset({"m2", "m5"}))
    members = parts(moe, plan)
    for part in members:
        check_part(plan, part)
    assert plan.network_bytes > 0
    check_schedules(plan, members, min_budget(plan))
    check_schedules(plan, members, 1 << 20)


@pytest.mark.parametrize("model", ["llama-70b", "qwen3-235b-a22b"])
def test_member_part_at_1024_ranks(model: str) -> None:
    spec = preset(model)
    old, new = layouts(model)
    plan = build_plan(spec, old, new)
    chosen = [old.members[5], old.members[-1], new.members[-1], old.members[500]]
    members = parts(spec, plan, chosen)
    for part in members:
        check_part(plan, part)
    check_schedules(plan, members, 1 << 28)


def test_traffic_of_another_plan_is_refused() -> None:
    tiny = preset("tiny")
    old = Layout.create(tiny, names(2), dp=2)
    new = Layout.create(tiny, names(2), tp=2)
    part = member_plan(tiny, old, new, "m0")
    other = plan_traffic(build_plan(tiny, old, Layout.create(tiny, names(2), pp=2)))
    assert len(other.loads) == 11 != len(part.patterns) == 6
    with pytest.raises(InvalidInput, match="patterns"):
        member_schedule(part, other, 1 << 20)
    with pytest.raises(InvalidInput, match="values"):
        member_traffic(part).from_vector([1, 2, 3])
    with pytest.raises(InvalidInput, match="slot"):
        member_schedule(part, member_traffic(part), 1 << 20).slot_rounds(part.slot + 1)


def test_pieces_are_taken_inside_pods_where_a_holder_is() -> None:
    # Two pods of two, tp inside pods; dp=4 needs both tp halves everywhere. The other half is
    # held in each member's pod (by its tp partner) and in the other pod: with pods, every piece
    # comes from the partner; without, the rotation over both holders sends some across.
    tiny = preset("tiny")
    old = Layout.create(tiny, names(4), dp=2, tp=2)
    new = Layout.create(tiny, names(4), dp=4)
    pods = {"m0": "a", "m1": "a", "m2": "b", "m3": "b"}
    plan = build_plan(tiny, old, new, pods=pods)
    alone = build_plan(tiny, old, new)
    check_plan(tiny, old, new, plan)
    members = parts(tiny, plan)
    for part in members:
        check_part(plan, part)
    check_schedules(plan, members, min_budget(plan))

    def across(p: Plan) -> int:
        pod = [pods[m] for m in p.members]
        return sum(1 for _, _, t in p.items() if pod[t.src] != pod[t.dst])

    assert plan.network_bytes == alone.network_bytes > 0
    assert across(plan) == 0 < across(alone)
    assert plan.across_pods_bytes() == 0 < alone.across_pods_bytes(pods) < alone.network_bytes
    assert alone.across_pods_bytes() == alone.network_bytes  # no pods: every byte crosses
    assert plan.digest != alone.digest
    # A needer whose pod holds nothing of a box takes it from anywhere: a third pod joining.
    grown = Layout.create(tiny, names(6), dp=3, tp=2)
    plan = build_plan(tiny, old, grown, pods={**pods, "m4": "c", "m5": "c"})
    check_plan(tiny, old, grown, plan)
    check_inside_pods(tiny, plan)
