"""Member assignment: exact against brute force, the lower bound, and the one-node case."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.assign.assign import (
    Problem,
    best_assignment,
    grouped_members,
    ordered_assignment,
    pod_slots,
)
from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Degrees, Layout, parse_degrees
from liveshard_core.plan.bounds import lower_bound_bytes
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec
from tests.core.helpers import brute_lower_bound, configs, degrees

TINY = preset("tiny")


def named(degrees: Degrees, spec: ModelSpec, members_to: list[int | None] | tuple[int | None, ...]
          ) -> Layout:  # fmt: skip
    """The new layout of an assignment: old members keep their number, joiners are n0, n1..."""
    fresh = iter(range(len(members_to)))
    return degrees.layout(
        spec, [str(m) if m is not None else f"n{next(fresh)}" for m in members_to]
    )


def old_layout(degrees: Degrees, spec: ModelSpec) -> Layout:
    return degrees.layout(spec, [str(i) for i in range(degrees.world_size)])


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_best_assignment_is_optimal_by_brute_force(data: st.DataObject) -> None:
    spec = ModelSpec.from_config(data.draw(configs()))
    a, b = data.draw(degrees(spec, 5)), data.draw(degrees(spec, 5))
    old = old_layout(a, spec)
    survivors = sorted(data.draw(st.sets(st.integers(0, a.world_size - 1)), label="survivors"))
    joiners = data.draw(st.integers(max(b.world_size - len(survivors), 0), b.world_size))
    result = best_assignment(spec, old, old_layout(b, spec), survivors, joiners)
    taking = b.world_size - joiners
    best = min(
        brute_lower_bound(spec, old, named(b, spec, _place(b.world_size, ranks, chosen)))
        for chosen in itertools.permutations(survivors, taking)
        for ranks in itertools.combinations(range(b.world_size), taking)
    )
    # Its figures are the plan's, recomputed from regions alone.
    assert brute_lower_bound(spec, old, named(b, spec, result.members_to)) == result.network_bytes
    assert result.network_bytes == best
    assert result.lower_bound_bytes <= best
    assert sum(m is None for m in result.members_to) == joiners
    placed = {m for m in result.members_to if m is not None}
    assert set(result.spares) == set(survivors) - placed
    assert (
        result.network_bytes
        <= ordered_assignment(spec, old, old_layout(b, spec), survivors, joiners).network_bytes
    )


def _place(size: int, ranks: tuple[int, ...], chosen: tuple[int, ...]) -> list[int | None]:
    out: list[int | None] = [None] * size
    for rank, member in zip(ranks, chosen, strict=True):
        out[rank] = member
    return out


def test_one_node_leaves_llama_70b() -> None:
    # 1024 ranks (tp8 pp8 dp16, ZeRO-1), one node (members 40-47: stage 0, dp index 5) leaves;
    # 960 ranks of dp15 remain. In order, every member after 40 shifts: most state moves.
    spec = preset("llama-70b")
    old = old_layout(parse_degrees("tp=8,pp=8,dp=16,zero=1"), spec)
    new = parse_degrees("tp=8,pp=8,dp=15,zero=1")
    survivors = [i for i in range(1024) if not 40 <= i < 48]
    problem = Problem(spec, old, new)
    best = problem.best(survivors, 0)
    ordered = problem.given([*survivors[:960]], survivors)
    assert ordered.network_bytes == 1064899519104  # the 1.06 TB of the issue
    assert best.network_bytes <= 0.5 * ordered.network_bytes
    assert best.lower_bound_bytes <= best.network_bytes <= 1.05 * best.lower_bound_bytes
    # Every stage but the first keeps one spare per tp rank: 7 stages x 8.
    assert len(best.spares) == 56 and not set(best.spares) & set(range(40, 48))
    # The plan of the chosen members moves exactly those bytes.
    assert lower_bound_bytes(spec, old, named(new, spec, best.members_to)) == best.network_bytes


def test_members_keeping_their_coordinates_keep_their_bytes() -> None:
    old = old_layout(parse_degrees("tp=2,dp=4,zero=1"), TINY)
    result = best_assignment(TINY, old, old, list(range(8)), 0)
    assert result.members_to == tuple(range(8))
    assert result.network_bytes == 0 == result.lower_bound_bytes


def test_joiners_take_the_ranks_nobody_holds() -> None:
    # dp=2 -> dp=4 under ZeRO-1: each old member keeps its half of the fp32 state on the new rank
    # whose quarter lies in it; the joiners take the others.
    old = old_layout(parse_degrees("dp=2,zero=1"), TINY)
    result = best_assignment(TINY, old, old_layout(parse_degrees("dp=4,zero=1"), TINY), [0, 1], 2)
    assert sorted(m for m in result.members_to if m is not None) == [0, 1]
    assert result.members_to.index(0) in (0, 1) and result.members_to.index(1) in (2, 3)


def test_too_few_survivors_is_an_error() -> None:
    old = old_layout(parse_degrees("dp=2"), TINY)
    with pytest.raises(InvalidInput, match="1 remaining members \\+ 0 added != 2"):
        best_assignment(TINY, old, old, [0], 0)
    with pytest.raises(InvalidInput, match="survivors \\[5\\]"):
        best_assignment(TINY, old, old, [5], 1)


@pytest.mark.parametrize(
    ("before", "after"),
    [("dp=4,zero=1", "dp=2,tp=2,zero=1"), ("dp=2,tp=2,zero=1", "dp=3,tp=2,zero=1"),
     ("pp=2,dp=2,zero=0", "tp=2,dp=3,zero=1"), ("dp=4,zero=0", "tp=2,pp=2,zero=0")],
)  # fmt: skip
def test_grouped_members_keep_the_most_bytes_a_pod_aligned_choice_can(
    before: str, after: str
) -> None:
    # Members in pods of 2 (p0: a b, p1: c d, p2: e f joining); each tp group must be one pod's
    # slot. The choice keeps as many bytes as the best of every slot order, and places every
    # survivor it can before a joiner.
    old = parse_degrees(before).layout(TINY, ["a", "c", "b", "d"])
    new = parse_degrees(after)
    slots = [["a", "b"], ["c", "d"], ["e", "f"]]
    members = grouped_members(TINY, old, new, slots)
    groups = [members[i : i + 2] for i in range(0, len(members), 2)]
    assert all(g in slots for g in groups) and len(groups) == new.world_size // 2
    survivors = [old.rank_of(m) for m in old.members]
    problem = Problem(TINY, old, new)

    def network(order: list[list[str]]) -> int:
        flat = [m for slot in order for m in slot]
        to = [old.rank_of(m) if m in old.members else None for m in flat]
        return problem.given(to, survivors).network_bytes

    placed = sum(m in old.members for m in members)
    best = min(
        network(list(order))
        for order in itertools.permutations(slots, len(groups))
        if sum(m in old.members for slot in order for m in slot) == placed
    )
    assert placed == min(len(old.members), new.world_size) and network(groups) == best
    with pytest.raises(InvalidInput, match="slots of tp=2"):
        grouped_members(TINY, old, new, [["a", "b"]])


def test_pod_slots_cut_each_pod_tp_at_a_time_in_old_rank_order() -> None:
    old = parse_degrees("dp=4").layout(TINY, ["d", "c", "b", "a"])
    pod_of = {"a": "p0", "b": "p0", "c": "p0", "d": "p1", "e": "p1", "f": "p2"}
    members = ["a", "b", "c", "d", "e", "f"]
    # p0: c, b, a by old rank (one left over); p1: d, then the joiner e; f alone fills none.
    assert pod_slots(members, 2, old, pod_of) == [["c", "b"], ["d", "e"]]
    assert pod_slots(members, 2, None, pod_of) == [["a", "b"], ["d", "e"]]
    assert pod_slots(members, 1, old, pod_of) is None and pod_slots(members, 2, old, {}) is None
