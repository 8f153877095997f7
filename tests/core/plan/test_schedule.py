"""Schedules: rounds under a per-member budget, exact re-tiling, and matched send/recv order."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.layout.layout import Layout
from liveshard_core.plan.matching import Piece
from liveshard_core.plan.plan import Plan, build_plan
from liveshard_core.plan.schedule import Schedule, build_schedule
from liveshard_core.vps.box import Box, volume
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import StateKind, TensorRef
from tests.core.helpers import Case, cases, inside, pairwise_disjoint

TINY = preset("tiny")
MOE = preset("tiny-moe")

Op = tuple[TensorRef, Piece]


def row_bytes(box: Box, itemsize: int) -> int:
    return volume(box) // (box[0][1] - box[0][0]) * itemsize


def max_row_bytes(plan: Plan) -> int:
    return max((row_bytes(t.box, size) for _, size, t in plan.items() if t.src != t.dst), default=1)


def min_budget(plan: Plan) -> int:
    """The smallest budget a schedule accepts: one row of every piece one member sends or
    receives in one class of tensors."""
    out = 1
    for group in plan.groups:
        per: Counter[int] = Counter()
        for t in plan.pattern_of(group).network:
            per[t.src] += row_bytes(t.box, group.itemsize)
            per[t.dst] += row_bytes(t.box, group.itemsize)
        out = max(out, *per.values(), 1)
    return out


def check_schedule(plan: Plan, schedule: Schedule) -> None:
    spec = plan.spec
    size_of = {ref: spec.dtype(ref.kind).itemsize for ref in spec.tensors()}
    members = range(len(plan.members))
    per_member = {m: schedule.slot_rounds(m) for m in members}
    rounds = len(schedule.rounds)
    assert all(len(r) == rounds for r in per_member.values())
    reported = schedule.round_bytes()
    assert len(reported) == rounds
    for r in range(rounds):
        for m in members:
            ops = per_member[m][r]
            # Every op involves m, crosses the network, and is non-empty.
            assert all(m in (t.src, t.dst) and t.src != t.dst for _, t in ops)
            assert all(volume(t.box) > 0 for _, t in ops)
            used = sum(volume(t.box) * size_of[ref] for ref, t in ops)
            assert reported[r].get(m, 0) == used
            assert used <= schedule.budget, (r, m, used)
    # Deadlock freedom: in every round, the sends a -> b that a posts are exactly the receives
    # from a that b posts, in the same order.
    for r in range(rounds):
        for a in members:
            sends: dict[int, list[Op]] = defaultdict(list)
            for ref, t in per_member[a][r]:
                if t.src == a:
                    sends[t.dst].append((ref, t))
            for b in members:
                if b == a:
                    continue
                recvs = [(ref, t) for ref, t in per_member[b][r] if t.dst == b and t.src == a]
                assert sends.get(b, []) == recvs, (r, a, b)
    # The chunks re-tile the plan's network transfers exactly.
    planned: dict[tuple[TensorRef, int, int], list[Box]] = defaultdict(list)
    for ref, _, t in plan.items():
        if t.src != t.dst:
            planned[(ref, t.src, t.dst)].append(t.box)
    scheduled: dict[tuple[TensorRef, int, int], list[Box]] = defaultdict(list)
    for m in members:
        for ops in per_member[m]:
            for ref, t in ops:
                if t.src == m:
                    scheduled[(ref, t.src, t.dst)].append(t.box)
    assert set(scheduled) == set(planned)
    for key, boxes in planned.items():
        chunks = scheduled[key]
        assert pairwise_disjoint(chunks), key
        for c in chunks:
            assert sum(inside(c, box) for box in boxes) == 1, (key, c)
        for box in boxes:
            assert sum(volume(c) for c in chunks if inside(c, box)) == volume(box), (key, box)


@settings(max_examples=60, deadline=None)
@given(cases(max_world=6), st.data())
def test_schedule_invariants(case: Case, data: st.DataObject) -> None:
    plan = build_plan(case.spec, case.old, case.new)
    low = min_budget(plan)
    if low > 1:
        with pytest.raises(ValueError, match="below one row"):
            build_schedule(plan, low - 1)
    _, recvs = plan.slot_bytes
    high = max([low, *recvs.values()]) * 2
    budget = data.draw(
        st.one_of(st.just(low), st.integers(low, 4 * low), st.integers(low, high)), label="budget"
    )
    schedule = build_schedule(plan, budget)
    assert schedule.budget == budget
    if plan.network_bytes == 0:
        assert schedule.rounds == ()
    check_schedule(plan, schedule)


@pytest.mark.parametrize("budget", [2, 100, 4096, 10**5, 2**30])
def test_schedule_on_preset(budget: int) -> None:
    # tiny-moe, 4 members, every kind of change at once. The widest row that moves is an fp32
    # row of hidden width: 64 * 4 = 256 bytes (embed, lm_head, router; tp=2 halves only the
    # columns of o and down).
    old = Layout.create(MOE, ["m0", "m1", "m2", "m3"], dp=2, pp=2, ep=2, zero=1)
    new = Layout.create(MOE, ["m3", "n0", "m1", "n1"], dp=2, tp=2, zero=3)
    plan = build_plan(MOE, old, new)
    assert max_row_bytes(plan) == 256
    if budget < 256:
        with pytest.raises(ValueError, match="below one row"):
            build_schedule(plan, budget)
        return
    schedule = build_schedule(plan, budget)
    check_schedule(plan, schedule)
    # A budget covering each member's whole traffic needs a single round.
    if budget >= 2 * plan.network_bytes:
        assert len(schedule.rounds) == 1


def test_one_piece_cut_into_chunks() -> None:
    # 1 -> 2 members, dp=2 zero=0, tiny: n0 needs everything from m0. The widest row is an fp32
    # row of down (192 * 4 = 768 bytes); with a budget of 4096 bytes the embed master
    # ([256, 64] fp32, 256 bytes a row, 65536 bytes in all) is cut into chunks of
    # 4096 // 256 = 16 rows: 256 / 16 = 16 chunks.
    old = Layout.create(TINY, ["m0"])
    new = Layout.create(TINY, ["m0", "n0"], dp=2)
    plan = build_plan(TINY, old, new)
    schedule = build_schedule(plan, 4096)
    check_schedule(plan, schedule)
    embed_master = TensorRef(0, StateKind.MASTER)
    chunks = [t.box for ops in schedule.slot_rounds(1) for ref, t in ops if ref == embed_master]
    assert sorted(chunks) == [((r, r + 16), (0, 64)) for r in range(0, 256, 16)]
    # Each chunk fills a member's whole budget (4096 bytes), so no two share a round.
    rounds = [i for i, ops in enumerate(schedule.slot_rounds(1))
              for ref, _ in ops if ref == embed_master]  # fmt: skip
    assert len(set(rounds)) == 16


def test_budget_below_one_row_names_the_tensor() -> None:
    # dp=1 -> dp=2 without ZeRO: the new member needs all of embed first; one bf16 row of it is
    # 64 * 2 = 128 bytes, above a budget of 100.
    old = Layout.create(TINY, ["m0"])
    plan = build_plan(TINY, old, Layout.create(TINY, ["m0", "n0"], dp=2))
    with pytest.raises(
        ValueError, match=r"budget 100 bytes is below one row \(128 bytes\) of embed"
    ):
        build_schedule(plan, 100)
    with pytest.raises(ValueError, match="budget"):
        build_schedule(plan, 0)


def test_rounds_by_hand() -> None:
    # tp=1 -> tp=2 adds n0, which receives (see test_plan) 107072 elements * 14 bytes; m0 sends
    # the same. Each member's load per round is what it sends plus what it receives: m0 only
    # sends, n0 only receives, so 1499008 bytes per member fit one round of 1499008 bytes.
    old = Layout.create(TINY, ["m0"])
    plan = build_plan(TINY, old, Layout.create(TINY, ["m0", "n0"], tp=2))
    assert len(build_schedule(plan, 1499008).rounds) == 1
    schedule = build_schedule(plan, 1499008 - 1)
    assert len(schedule.rounds) >= 2
    check_schedule(plan, schedule)
