"""Training through live layout switches: local jobs of several processes (gloo, CPU, fp32).

Every job trains `tiny` (or `tiny-moe`) for 30 steps with dropout on, and switches at steps 10 and
20. It is compared with a one-process run of the same seed that never switches:
- every switch commits, and the whole state's checksum totals right after it equal those right
  before it (the state moved bit for bit);
- the losses agree step by step within a relative 1e-4. The runs differ only in the order of
  floating-point reductions (how tp splits a matmul, how dp sums gradients): measured differences
  are about 1e-7 relative over 30 steps; 1e-4 leaves room for their growth without admitting a
  real difference (a wrong gradient scale, a lost sample or a different dropout mask changes the
  loss by 1e-2 or more within a step or two).
Each job starts up to 6 processes.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache, partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from liveshard_agent.local.launcher import (
    LocalJob,
    ScriptedSwitch,
    local_config,
    parse_switch,
    run_job,
)
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from tests.agent.runtime.faults import votes_no

STEPS = 30
RTOL = 1e-4
SETTINGS = TrainingSettings(steps=STEPS, dropout=0.1)


def job(model: str, layout: str, *switches: str | ScriptedSwitch, **options: Any) -> LocalJob:
    degrees = parse_degrees(layout)
    return LocalJob(
        config=local_config(
            model, options.pop("settings", SETTINGS), precision=options.pop("precision", None)
        ),
        nprocs=degrees.world_size, layout=degrees,
        switches=tuple(parse_switch(s) if isinstance(s, str) else s for s in switches),
        checksums=True,
        record_samples=True, **options,
    )  # fmt: skip


@cache
def baseline(model: str) -> tuple[float, ...]:
    return losses(run_job(job(model, "dp=1")))


def losses(events: list[dict[str, Any]]) -> tuple[float, ...]:
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(len(steps)))
    return tuple(e["loss"] for e in steps)


def switches(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "switch"]


def assert_same_training(model: str, events: list[dict[str, Any]]) -> None:
    expected = baseline(model)
    got = losses(events)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == pytest.approx(b, rel=RTOL), f"step {step}: {a} != {b}"
    # Every sample of every step was fed exactly once, whatever the layout at that step.
    fed = sorted(s for e in events if e["event"] == "samples" for s in e["samples"])
    assert fed == list(range(STEPS * SETTINGS.global_batch))


SCENARIOS = {
    # dimension: (model, first layout, switch at 10, switch at 20)
    "dp, 2 members join then 1 leaves": ("tiny", "dp=2", "10:dp=4", "20:dp=3"),
    "tp": ("tiny", "dp=4", "10:tp=2,dp=2", "20:tp=2,dp=1"),
    "pp even then uneven": ("tiny", "dp=4", "10:pp=2,dp=2", "20:pp=2,pp_layers=1:3,dp=2"),
    "pp 4 stages": ("tiny", "pp=2,dp=2", "10:pp=4", "20:tp=2,dp=2"),
    "zero 0 -> 1 -> 3": ("tiny", "dp=4", "10:dp=4,zero=1", "20:tp=2,dp=2,zero=3"),
    "zero 3 with pp and uneven shards": ("tiny", "dp=3,zero=3", "10:pp=2,dp=3,zero=3",
                                         "20:dp=4,zero=1"),
    "ep": ("tiny-moe", "dp=4,ep=2,zero=1", "10:dp=2,ep=1", "20:tp=2,dp=2,ep=2,zero=3"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_training_through_switches_matches_a_run_without(name: str) -> None:
    model, layout, *scripted = SCENARIOS[name]
    events = run_job(job(model, layout, *scripted))
    done = switches(events)
    # Each at the first boundary at or after its step at which every member is prepared (new
    # members' processes start while the job trains).
    assert len(done) == 2 and 10 <= done[0]["step"] < 20 <= done[1]["step"] < STEPS
    for e in done:
        assert e["result"] == "committed", e
        assert e["checksums"]["before"] == e["checksums"]["after"], e
        assert e["pause_seconds"] > 0
    assert_same_training(model, events)


def test_a_replaced_member_one_brought_back_and_two_exchanged() -> None:
    # Mirrored ZeRO-1: w2 leaves at step 10 and a fresh member w4 takes its rank; at step 20 w2
    # comes back; at 25 w1 and w2 exchange ranks (the operator's respread), each taking the
    # other's shards.
    ring = parse_degrees("dp=4,zero=1,mirror=1")
    text = "dp=4,zero=1,mirror=1"
    replace = ScriptedSwitch(10, ring, text, ("w0", "w1", "w4", "w3"))
    back = ScriptedSwitch(20, ring, text, ("w0", "w1", "w2", "w3"))
    exchange = ScriptedSwitch(25, ring, text, ("w0", "w2", "w1", "w3"))
    events = run_job(job("tiny", text, replace, back, exchange))
    assert [e["result"] for e in switches(events)] == ["committed"] * 3
    assert all(e["network_bytes"] > 0 for e in switches(events))
    fed_by = {e["member"] for e in events if e["event"] == "samples" and 10 <= e["step"] < 20}
    assert fed_by == {"w0", "w1", "w4", "w3"}
    assert_same_training("tiny", events)


def test_bf16_parameters_with_an_fp32_master_switch_exactly() -> None:
    """The GPU precision (bf16 parameters, fp32 master and moments), run on CPU: the switch
    moves the master copies too, and training goes on near the fp32 run."""
    events = run_job(job("tiny", "tp=2,dp=2", "10:pp=2,dp=2,zero=1", "20:dp=4,zero=3",
                         precision="bf16"))  # fmt: skip
    for e in switches(events):
        assert e["result"] == "committed" and e["checksums"]["before"] == e["checksums"]["after"]
    got = losses(events)
    assert got[-1] == pytest.approx(baseline("tiny")[-1], rel=0.02)  # bf16 rounding, not a bug
    assert got[-1] < got[0] - 2


def test_gradients_are_normalised_by_the_global_batch_not_by_dp() -> None:
    one_step = dataclasses.replace(SETTINGS, steps=2, dropout=0.0)
    runs = {dp: run_job(job("tiny", f"dp={dp}", settings=one_step)) for dp in (2, 4)}
    first = {dp: [e for e in ev if e["event"] == "step"] for dp, ev in runs.items()}
    # The same gradient norm at step 0, and the same loss after the first update.
    assert first[2][0]["grad_norm"] == pytest.approx(first[4][0]["grad_norm"], rel=1e-6)
    assert first[2][1]["loss"] == pytest.approx(first[4][1]["loss"], rel=1e-6)


def test_a_checkpoint_loads_into_another_layout_and_training_goes_on(tmp_path: Path) -> None:
    saved = run_job(job("tiny", "tp=2,dp=2,zero=1", checkpoint_dir=str(tmp_path),
                        checkpoint_every=15))  # fmt: skip
    assert [e["step"] for e in saved if e["event"] == "checkpoint"] == [15, 30]
    resumed = run_job(job("tiny", "pp=3,zero=3", resume=str(tmp_path / "step-15")))
    before, after = losses(saved), [e["loss"] for e in resumed if e["event"] == "step"]
    assert [e["step"] for e in resumed if e["event"] == "step"] == list(range(15, STEPS))
    assert after == pytest.approx(list(before[15:]), rel=RTOL)


def test_a_switch_whose_vote_fails_leaves_training_in_the_old_layout() -> None:
    events = run_job(job("tiny", "dp=4", "10:tp=2,dp=2", hooks=partial(votes_no, "w1")))
    (aborted,) = switches(events)
    assert (aborted["result"], aborted["cause"]) == ("aborted", "vote_no")
    assert "1 member(s) voted no" in aborted["reason"] or "w1 refuses" in aborted["reason"]
    layouts = {e["layout"] for e in events if e["event"] == "step"}
    assert layouts == {"dp=4,tp=1,pp=1,ep=1,zero=0,pp_layers=4"}
    assert_same_training("tiny", events)


def test_an_expert_rank_that_gets_no_token_still_takes_part_in_the_backward(
    tmp_path: Path,
) -> None:
    # One token per member and 16 experts per ep rank: in most micro-batches some rank's
    # experts get no token. It must still post the backward's all-to-alls its peers post.
    sparse = {"name": "moe-sparse", "vocab": 256, "hidden": 32, "layers": 2, "heads": 2,
              "kv_heads": 1, "head_dim": 16, "ffn": 64, "experts": 64, "expert_ffn": 8,
              "top_k": 1}  # fmt: skip
    model = tmp_path / "moe-sparse.json"
    model.write_text(json.dumps(sparse))
    settings = TrainingSettings(steps=4, global_batch=4, micro_batch=1, seq_len=1)
    runs = {
        layout: losses(run_job(job(str(model), layout, settings=settings)))
        for layout in ("dp=1", "dp=4,ep=4")
    }
    assert runs["dp=4,ep=4"] == pytest.approx(runs["dp=1"], rel=RTOL)
