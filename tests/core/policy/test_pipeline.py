"""Pipeline rebalancing and packing: optimal against brute force; DynMo's imbalance cases."""

from __future__ import annotations

from itertools import combinations, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.errors import InvalidInput
from liveshard_core.policy.pipeline import LayerCosts, balance, evaluate, pack


def compositions(layers: int, stages: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        out.append(tuple(b - a for a, b in pairwise(bounds)))
    return out


@st.composite
def layer_costs(draw: st.DrawFn) -> LayerCosts:
    n = draw(st.integers(1, 9))
    seconds = tuple(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    memory = tuple(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    return LayerCosts(
        tuple(float(s) for s in seconds), memory, float(draw(st.integers(0, 9))),
        float(draw(st.integers(0, 9))), draw(st.integers(0, 5)), draw(st.integers(0, 5)),
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(layer_costs(), st.data())
def test_balance_is_optimal_by_brute_force(costs: LayerCosts, data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, costs.layers))
    cap = data.draw(st.one_of(st.none(), st.integers(0, 40)))
    fitting = [
        evaluate(costs, p)
        for p in compositions(costs.layers, stages)
        if cap is None or max(evaluate(costs, p).stage_bytes) <= cap
    ]
    if not fitting:
        with pytest.raises(InvalidInput, match="memory cap"):
            balance(costs, stages, cap)
        return
    best = balance(costs, stages, cap)
    assert best.max_seconds == min(p.max_seconds for p in fitting)
    assert cap is None or max(best.stage_bytes) <= cap
    assert sum(best.pp_layers) == costs.layers and min(best.pp_layers) >= 1
    # Among optimal partitions, the fewest layers leave their current stage.
    current = data.draw(st.sampled_from(compositions(costs.layers, stages)))
    moved = balance(costs, stages, cap, current)
    assert moved.max_seconds == best.max_seconds

    def moves(p: tuple[int, ...]) -> int:
        owner = [s for s, n in enumerate(current) for _ in range(n)]
        mine = [s for s, n in enumerate(p) for _ in range(n)]
        return sum(a != b for a, b in zip(owner, mine, strict=True))

    optimal = [p.pp_layers for p in fitting if p.max_seconds == best.max_seconds]
    assert moves(moved.pp_layers) == min(moves(p) for p in optimal)


@settings(max_examples=150, deadline=None)
@given(layer_costs(), st.data())
def test_pack_uses_the_fewest_stages_within_tolerance(
    costs: LayerCosts, data: st.DataObject
) -> None:
    stages = data.draw(st.integers(1, costs.layers))
    current = data.draw(st.sampled_from(compositions(costs.layers, stages)))
    tolerance = data.draw(st.sampled_from([0.0, 0.05, 0.5]))
    today = evaluate(costs, current).max_seconds
    packed = pack(costs, current, tolerance)
    assert len(packed.pp_layers) <= stages
    assert packed.max_seconds <= today * (1 + tolerance) + 1e-9
    for fewer in range(1, len(packed.pp_layers)):
        best = min(evaluate(costs, p).max_seconds for p in compositions(costs.layers, fewer))
        assert best > today * (1 + tolerance)


def test_first_and_last_stage_carry_embedding_and_head() -> None:
    # 4 equal layers; a heavy head (3 s) on the last stage pushes its layers to the others.
    costs = LayerCosts((1.0, 1.0, 1.0, 1.0), last_seconds=3.0, first_seconds=0.5)
    assert balance(costs, 2).pp_layers == (3, 1)
    assert balance(costs, 2).stage_seconds == (3.5, 4.0)


# DynMo's dynamic models (Wahib et al., SC'25): the per-layer cost changes during training and
# the static even partition goes out of balance. 32 layers of 1 s, 4 stages of 8 layers.
EVEN = (8, 8, 8, 8)


def test_frozen_early_layers() -> None:
    # The first 16 layers are frozen: no weight gradients, about a third of the cost is left
    # (forward plus input gradients only where needed): 1/3 s per frozen layer.
    costs = LayerCosts(tuple([1 / 3] * 16 + [1.0] * 16))
    before = evaluate(costs, EVEN)
    after = balance(costs, 4, current=EVEN)
    assert before.max_seconds == 8.0
    # 16/3 + 16 = 21.3 s of work on 4 stages; with whole layers the best is 6.0 s (the frozen
    # 16 on one stage, 6 + 5 + 5 dense layers on the others); brute force agrees.
    assert after.max_seconds == pytest.approx(min(
        evaluate(costs, p).max_seconds for p in compositions(32, 4)))  # fmt: skip
    assert after.max_seconds == pytest.approx(6.0)
    assert before.max_seconds / after.max_seconds == pytest.approx(4 / 3)


def test_pruned_layers() -> None:
    # Gradual pruning left the last 16 layers at 10% of their cost.
    costs = LayerCosts(tuple([1.0] * 16 + [0.1] * 16))
    before, after = evaluate(costs, EVEN), balance(costs, 4, current=EVEN)
    assert (before.max_seconds, after.max_seconds) == (8.0, pytest.approx(5.0))
    assert after.pp_layers[:2] == (5, 5)  # 5 s each; the pruned tail fills the rest
    assert before.max_seconds / after.max_seconds == pytest.approx(1.6)
    # Packing (DynMo): 17.6 s of work fits 3 stages of at most today's 8 s (6 + 6 + 5.6), not
    # 2; a whole stage's members are released at no cost in step time.
    packed = pack(costs, EVEN, tolerance=0.0)
    assert len(packed.pp_layers) == 3
    assert packed.max_seconds == pytest.approx(6.0)


def test_moe_layers_with_skewed_load() -> None:
    # Routing skew makes every fourth (MoE) layer 2.5x as expensive as the others.
    costs = LayerCosts(tuple(2.5 if i % 4 == 3 else 1.0 for i in range(32)))
    before, after = evaluate(costs, EVEN), balance(costs, 4, current=EVEN)
    assert before.max_seconds == 11.0  # every stage: 6 x 1 + 2 x 2.5
    assert after.max_seconds == before.max_seconds  # evenly spread already: nothing to gain
    skewed = LayerCosts(tuple(4.0 if i in (3, 7, 11) else 1.0 for i in range(32)))
    before, after = evaluate(skewed, EVEN), balance(skewed, 4, current=EVEN)
    assert before.max_seconds == 14.0  # stage 0: 5 x 1 + 2 x 4 ... + 1 (layers 0-7)
    assert after.max_seconds == pytest.approx(min(
        evaluate(skewed, p).max_seconds for p in compositions(32, 4)))  # fmt: skip
    assert before.max_seconds / after.max_seconds > 1.2


def test_memory_cap_is_named() -> None:
    costs = LayerCosts((1.0, 1.0), (5, 5))
    with pytest.raises(InvalidInput, match="memory cap 4 bytes"):
        balance(costs, 2, memory_cap=4)
    with pytest.raises(InvalidInput, match="stages=3"):
        balance(costs, 3)
    with pytest.raises(InvalidInput, match="bytes lists 1 layers"):
        LayerCosts((1.0, 1.0), (5,))
