"""Recovery from a member that dies without notice: local jobs of several processes (gloo, CPU).

A member kills its own process (SIGKILL) as it begins a step (`--kill STEP:RANK`); the others'
world breaks in that step's first collective, and the launcher answers with a recovery: the same
layout, a new process in the dead member's place, the dead member `lost`. The job must train on
as if nothing happened: the losses equal a one-process run's step by step (within the
reduction-order tolerance of `test_training`), every sample is fed exactly once, and the step
that broke is trained once, after the recovery. Each job starts up to 6 processes.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from liveshard_agent.runtime.launcher import ScriptedKill, parse_kill, run_job
from liveshard_agent.runtime.member import recovery_decision
from liveshard_core.errors import InvalidInput
from tests.agent.runtime.test_training import assert_same_training, job, switches

SCENARIOS = {
    # name: (model, layout, kills, scripted switches)
    "dp, a member dies": ("tiny", "dp=4", ("10:1",), ()),
    "tp and dp, the first rank dies": ("tiny", "tp=2,dp=2", ("10:0",), ()),
    "pp, a last-stage member dies while a switch waits": ("tiny", "pp=2,dp=2", ("8:3",),
                                                          ("14:dp=4",)),
    "two members die at once": ("tiny", "dp=4", ("10:0", "10:3"), ()),
    "ep, experts from their other replica": ("tiny-moe", "dp=4,ep=2", ("5:2",), ("12:dp=4",)),
}  # fmt: skip


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in switches(events) if e["lost"]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_member_that_dies_is_replaced_and_training_goes_on_unchanged(name: str) -> None:
    model, layout, kills, scripted = SCENARIOS[name]
    events = run_job(job(model, layout, *scripted, kills=tuple(parse_kill(k) for k in kills)))
    lost = [e for e in events if e["event"] == "lost"]
    assert len(lost) == len(kills) and all(e["exit_code"] == -9 for e in lost)
    (recovery,) = recoveries(events)
    assert recovery["result"] == "committed", recovery
    assert sorted(recovery["lost"]) == sorted(e["member"] for e in lost)
    assert recovery["from"] == recovery["to"]  # the same layout, new members in the dead places
    broken = [e for e in events if e["event"] == "broken"]
    assert broken and {e["step"] for e in broken} == {recovery["step"]}
    assert all(e["whole"] for e in broken)
    # A scripted switch that was waiting is sent again after the recovery and commits.
    later = [e for e in switches(events) if not e["lost"] and e["result"] == "committed"]
    assert len(later) == len(scripted)
    assert_same_training(model, events)


def test_a_loss_without_a_surviving_copy_stops_the_job_naming_it() -> None:
    # ZeRO-1 on two members: each holds the only copy of half the optimizer state.
    with pytest.raises(RuntimeError, match=r"no surviving copy .* restore from a checkpoint"):
        run_job(job("tiny", "dp=2,zero=1", kills=(ScriptedKill(5, 1),)))


def test_kill_is_parsed_and_refused_when_malformed() -> None:
    assert parse_kill("15:1") == ScriptedKill(15, 1)
    for text in ("15", "a:1", "15:-1", "15:x"):
        with pytest.raises(InvalidInput, match="STEP:RANK"):
            parse_kill(text)


# ---- the first survivor's decision ----


def report(step: int, whole: bool) -> dict[str, Any]:
    scalars = {"step": step, "adam_step": step, "samples": step * 24, "seed": 0}
    return {"scalars": scalars, "step": step, "whole": whole, "reason": "test"}


@pytest.mark.parametrize(
    ("reports", "why"),
    [
        ({"m0": report(7, True), "m2": report(7, True)}, None),
        ({"m0": report(7, True), "m2": report(8, True)}, "different steps {'m0': 7, 'm2': 8}"),
        ({"m0": report(7, True), "m2": report(7, False)}, "middle of an update at ['m2']"),
    ],
)
def test_survivors_switch_at_their_common_step_or_learn_why_there_is_none(
    reports: dict[str, dict[str, Any]], why: str | None
) -> None:
    decision = recovery_decision(reports)
    if why is None:
        assert decision == {"step": 7, "scalars": reports["m0"]["scalars"]}
    else:
        assert decision["cause"] == "no_common_state"
        assert why in decision["abort"] and "restore from a checkpoint" in decision["abort"]
