"""The live rebalancing decision: windows of measured costs, when to switch, pack and grow."""

from __future__ import annotations

import pytest

from liveshard_core.errors import InvalidInput
from liveshard_core.job import JobConfig
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import Degrees
from liveshard_core.plan.predict import predicted_pause
from liveshard_core.policy.rebalance import (
    GROW,
    PACK,
    REBALANCE,
    CostWindow,
    StepCosts,
    imbalance,
    propose,
)
from liveshard_core.vps.presets import resolve_model

ON = RebalanceSettings(enabled=True, threshold=0.1, window_steps=4)
NO_PAUSE = lambda pp_layers: 0.0  # noqa: E731


def costs(*layers: float, first: float = 0.0, last: float = 0.0) -> StepCosts:
    return StepCosts(tuple(layers), first, last)


def test_the_window_reads_the_median_of_each_value_once_full() -> None:
    window = CostWindow(3)
    assert window.median() is None
    for value in (1.0, 9.0, 2.0):
        assert not window.full
        window.add(costs(value, 2 * value, last=value))
    assert window.full
    assert window.median() == costs(2.0, 4.0, last=2.0)  # one slow step does not move it
    window.add(costs(3.0, 6.0, last=3.0))  # the oldest leaves
    assert window.median() == costs(3.0, 6.0, last=3.0)
    with pytest.raises(InvalidInput, match="1 layers after 2"):
        window.add(costs(1.0))
    window.clear()
    assert window.median() is None


def test_an_imbalance_above_the_threshold_proposes_the_balanced_partition() -> None:
    measured = costs(1.0, 1.0, 1.0, 1.0)
    assert imbalance(measured, (3, 1)) == pytest.approx(1.5)
    proposal = propose(ON, measured, (3, 1), 8, NO_PAUSE)
    assert proposal is not None
    assert (proposal.kind, proposal.pp_layers) == (REBALANCE, (2, 2))
    assert proposal.step_seconds_before == pytest.approx(3.0 * 9 / 8)
    assert proposal.step_seconds_after == pytest.approx(2.0 * 9 / 8)
    assert proposal.gain == pytest.approx(1 / 3)
    assert (proposal.imbalance_before, proposal.imbalance_after) == (1.5, 1.0)


def test_the_head_and_embedding_count_with_their_stages() -> None:
    proposal = propose(ON, costs(1.0, 1.0, 1.0, 1.0, last=2.0), (2, 2), 8, NO_PAUSE)
    assert proposal is not None and proposal.pp_layers == (3, 1)


def test_no_switch_under_the_threshold_or_when_the_pause_eats_the_gain() -> None:
    slightly = costs(1.0, 1.0, 1.05, 1.0)
    assert propose(ON, slightly, (2, 2), 8, NO_PAUSE) is None  # 2.5% to win, 10% needed
    measured = costs(1.0, 1.0, 1.0, 1.0)
    # The window (4 steps) wins 4 x 1.125 s; a 5 s pause does not pay.
    assert propose(ON, measured, (3, 1), 8, lambda pp: 5.0) is None
    assert propose(ON, measured, (3, 1), 8, lambda pp: 4.0) is not None


def test_a_partition_left_before_needs_twice_the_threshold() -> None:
    # (3, 1) -> (2, 2) wins 1/3 of the step; going back to a partition left needs 20%.
    measured = costs(1.0, 1.0, 1.0, 1.0)
    assert propose(ON, measured, (3, 1), 8, NO_PAUSE, left=[(2, 2)]) is not None
    drifted = costs(1.0, 1.0, 1.0, 1.0, last=1.4)  # (2, 2) takes 3.4, (3, 1) 3.0: 12% won
    proposal = propose(ON, drifted, (2, 2), 8, NO_PAUSE)
    assert proposal is not None and proposal.pp_layers == (3, 1)
    assert propose(ON, drifted, (2, 2), 8, NO_PAUSE, left=[(3, 1)]) is None


def test_pack_uses_fewer_stages_when_the_work_fits_and_grows_back_when_it_does_not() -> None:
    packing = RebalanceSettings(enabled=True, threshold=0.1, window_steps=4, pack=True)
    frozen = costs(0.1, 0.1, 0.1, 1.0, last=0.5)  # three cheap layers, one full with the head
    proposal = propose(packing, frozen, (1, 1, 1, 1), 12, NO_PAUSE)
    assert proposal is not None and proposal.kind == PACK
    assert proposal.pp_layers == (3, 1)  # the bubble shrinks: faster on fewer members
    assert proposal.step_seconds_after < proposal.step_seconds_before
    # Back to the full work: four stages again, up to max_stages.
    full = costs(1.0, 1.0, 1.0, 1.0, last=0.5)
    proposal = propose(packing, full, (3, 1), 12, NO_PAUSE, max_stages=4)
    assert proposal is not None and proposal.kind == GROW and len(proposal.pp_layers) == 4
    # Without pack, the stage count never changes.
    assert propose(ON, frozen, (1, 1, 1, 1), 12, NO_PAUSE) is None


def test_a_memory_cap_keeps_stages_that_would_not_fit() -> None:
    measured = costs(1.0, 1.0, 1.0, 1.0)
    memory = ((10, 10, 10, 10), 0, 0)
    assert propose(ON, measured, (3, 1), 8, NO_PAUSE, memory=memory, memory_cap=20) is not None
    packing = RebalanceSettings(enabled=True, threshold=0.1, window_steps=4, pack=True)
    frozen = costs(0.1, 0.1, 0.1, 1.0, last=0.5)
    packed = propose(packing, frozen, (1, 1, 1, 1), 12, NO_PAUSE, memory=memory, memory_cap=20)
    assert packed is not None and packed.pp_layers == (2, 2)  # (3, 1) would not fit
    # Cheap layers alike do not pack: fewer stages would take longer.
    assert propose(packing, costs(0.1, 0.1, 0.1, 0.1), (1, 1, 1, 1), 12, NO_PAUSE) is None


def test_settings_are_checked_and_read_as_the_crd_spells_them() -> None:
    got = RebalanceSettings.from_dict(
        {"enabled": True, "threshold": 0.2, "windowSteps": 5, "pack": True}, "spec.rebalance", True
    )
    assert got == RebalanceSettings(True, 0.2, 5, True)
    with pytest.raises(InvalidInput, match=r"spec.rebalance.windowSteps=0"):
        RebalanceSettings.from_dict({"windowSteps": 0}, "spec.rebalance", crd=True)
    with pytest.raises(InvalidInput, match=r"threshold=1.5"):
        RebalanceSettings.from_dict({"threshold": 1.5})
    with pytest.raises(InvalidInput, match="unknown field"):
        RebalanceSettings.from_dict({"window": 3})
    config = JobConfig(model=resolve_model("tiny").config, rebalance=got)
    assert JobConfig.from_json(config.to_json()).rebalance == got


def test_the_predicted_pause_grows_with_the_bytes_moved() -> None:
    spec = resolve_model("tiny")
    members = ["a", "b"]
    old = Degrees(pp=2, pp_layers=(3, 1)).layout(spec, members)
    one = predicted_pause(spec, old, Degrees(pp=2, pp_layers=(2, 2)).layout(spec, members), 1 << 20)
    two = predicted_pause(spec, old, Degrees(pp=2, pp_layers=(1, 3)).layout(spec, members), 1 << 20)
    assert 0 < one < two


def test_the_pause_is_predicted_only_for_a_switch_the_step_times_call_for() -> None:
    asked: list[tuple[int, ...]] = []

    def pause(pp_layers: tuple[int, ...]) -> float:
        asked.append(pp_layers)
        return 0.0

    assert propose(ON, costs(1.0, 1.0, 1.05, 1.0), (2, 2), 8, pause) is None
    assert asked == []  # 2.5% to win: no transfer plan is built
    assert propose(ON, costs(1.0, 1.0, 1.0, 1.0), (3, 1), 8, pause) is not None
    assert asked == [(2, 2)]
