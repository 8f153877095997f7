"""Live rebalancing in local jobs (gloo, CPU): the layers' costs are measured every step, an
uneven pipeline is repartitioned while it trains, and the losses stay those of a run that never
switches (`test_training`'s baseline and tolerance)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from liveshard_agent.local.launcher import run_job
from liveshard_core.job import TrainingSettings
from liveshard_core.job.rebalance import RebalanceSettings
from tests.agent.runtime.test_training import assert_same_training, job, switches


def rebalancing(layout: str, rebalance: RebalanceSettings, **options: Any) -> Any:
    local = job("tiny", layout, **options)
    return dataclasses.replace(local, config=dataclasses.replace(local.config, rebalance=rebalance))


def test_each_step_reports_its_layers_and_stages_costs() -> None:
    events = run_job(job("tiny", "pp=2,pp_layers=3:1", settings=TrainingSettings(steps=4)))
    steps = [e for e in events if e["event"] == "step"]
    for step in steps:
        layers, stages = step["layer_seconds"], step["stage_seconds"]
        assert len(layers) == 4 and all(s > 0 for s in layers)
        assert step["first_seconds"] > 0 and step["last_seconds"] > 0
        # The stages are the layers they hold, with the embedding and the head.
        assert stages[0] == pytest.approx(sum(layers[:3]) + step["first_seconds"], abs=1e-5)
        assert stages[1] == pytest.approx(layers[3] + step["last_seconds"], abs=1e-5)
        assert step["imbalance"] == pytest.approx(max(stages) / (sum(stages) / 2), abs=1e-3)


def test_an_uneven_pipeline_is_rebalanced_live_once_and_trains_the_same() -> None:
    settings = RebalanceSettings(enabled=True, threshold=0.05, window_steps=4)
    events = run_job(rebalancing("pp=2,pp_layers=3:1", settings))
    done = switches(events)
    # One switch, no oscillation: the measured costs keep choosing the partition it has.
    assert len(done) == 1, done
    (switch,) = done
    assert switch["result"] == "committed" and switch["trigger"] == "rebalance"
    assert switch["to"].endswith("pp_layers=2:2") and switch["released"] == []
    before, after = switch["predicted_step_seconds"]
    assert after < before * (1 - settings.threshold)
    assert switch["imbalance"][1] < switch["imbalance"][0]
    assert_same_training("tiny", events)


def test_no_rebalance_under_the_threshold() -> None:
    settings = RebalanceSettings(enabled=True, threshold=0.5, window_steps=3)
    events = run_job(
        rebalancing("pp=2", settings, settings=TrainingSettings(steps=12, dropout=0.1))
    )
    assert switches(events) == []


def test_frozen_layers_cost_less_and_the_job_packs_onto_fewer_members() -> None:
    frozen = TrainingSettings(steps=20, dropout=0.1, freeze=((3, 3),))
    settings = RebalanceSettings(enabled=True, threshold=0.1, window_steps=3, pack=True)
    events = run_job(rebalancing("pp=4", settings, settings=frozen))
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(20))  # it trains on to its end
    # The three frozen layers run no backward: they cost less than the one that trains (about a
    # third), in every layout. Each layer's fastest frozen step is compared, and the frozen
    # layers' mean: 4 processes share 2 cores, and a busy core only adds time, at times to one
    # layer of a step, so one step alone may show no difference.
    measured = [e["layer_seconds"] for e in steps[4:]]
    fastest = [min(s[i] for s in measured) for i in range(4)]
    assert sum(fastest[:3]) / 3 < 0.8 * fastest[3], measured
    packs = [s for s in switches(events) if s["trigger"] == "pack"]
    assert packs and all(s["result"] == "committed" for s in packs)
    released = [m for s in packs for m in s["released"]]
    assert released and all(s["to"].count(":") < s["from"].count(":") for s in packs)
    # Packing moves layers, not the math: the losses of the same job on one process.
    unchanged = run_job(job("tiny", "dp=1", settings=frozen))
    expected = [e["loss"] for e in unchanged if e["event"] == "step"]
    for step, (a, b) in enumerate(zip([e["loss"] for e in steps], expected, strict=True)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: {a} != {b}"
