"""The fault matrix on local jobs: a member killed (or stopped) at each point of a switch, and a
vote whose all-reduce completes at some members only. Whatever fails where, every surviving
member ends in one layout at one step with an exact state, and the job trains on: the losses
equal a one-process run's and every sample is fed once (`assert_same_training`).

A switch's decision is recorded once in the store (`engine.vote.settle`): a member dying before
the decision aborts the switch everywhere, one dying after it leaves the others committed and is
recovered from in the new layout.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from liveshard_agent.local.launcher import parse_kill, run_job
from liveshard_core.job import Deadlines
from tests.agent.runtime.faults import loses_the_vote
from tests.agent.runtime.test_training import assert_same_training, job, switches

FROM, TO = "tp=2,dp=2", "pp=2,dp=2"  # every member sends and receives in this switch
OLD, NEW = "dp=2,tp=2,pp=1,ep=1,zero=0", "dp=2,tp=1,pp=2,ep=1,zero=0"
# Where the job recovers. (A death inside the transfer is the engine's `test_switch` case.)
AFTER = {"prepare": OLD, "vote": OLD, "commit": NEW}


def short(layout: str) -> str:
    return layout.split(",pp_layers")[0]


def layouts(events: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(short(e["layout"]) for e in events if e["event"] == "step"))


@pytest.mark.parametrize("phase", list(AFTER))
def test_a_member_killed_inside_a_switch_is_recovered_from_without_a_split(phase: str) -> None:
    events = run_job(job("tiny", FROM, f"10:{TO}", kills=(parse_kill(f"10:1:{phase}"),)))
    (lost,) = [e for e in events if e["event"] == "lost"]
    assert lost["exit_code"] == -9
    (recovery,) = [e for e in switches(events) if e["lost"]]
    assert recovery["result"] == "committed" and recovery["lost"] == [lost["member"]]
    # Before the decision, the switch aborts everywhere and the job recovers in the old layout
    # (then switches as scripted); after it, everyone committed and it recovers in the new one.
    assert short(recovery["from"]) == short(recovery["to"]) == AFTER[phase]
    assert layouts(events)[-1] == NEW
    assert_same_training("tiny", events)


@pytest.mark.parametrize("late", [1.0, -1.0], ids=["commit recorded first", "abort first"])
def test_a_vote_that_completes_at_some_members_only_never_splits(late: float) -> None:
    # w1's all-reduce "fails" while the others' completes with every vote yes: the first view
    # recorded is the decision, and every member, w1 included, acts on it.
    events = run_job(job("tiny", "dp=4", f"10:{FROM}", hooks=partial(loses_the_vote, "w1", late)))
    (switch,) = switches(events)
    if late > 0:
        assert switch["result"] == "committed"
        assert layouts(events) == ["dp=4,tp=1,pp=1,ep=1,zero=0", OLD]
    else:
        assert (switch["result"], switch["cause"]) == ("aborted", "vote_incomplete")
        assert "w1's all-reduce failed" in switch["reason"]
        assert layouts(events) == ["dp=4,tp=1,pp=1,ep=1,zero=0"]
    assert_same_training("tiny", events)


def test_a_stopped_member_is_found_silent_killed_and_replaced() -> None:
    stopping = job("tiny", "dp=4", kills=(parse_kill("10:2", hang=True),))
    fast = Deadlines(op=5, switch=10, prepare=30)
    events = run_job(replace(stopping, config=replace(stopping.config, deadlines=fast)))
    (silent,) = [e for e in events if e["event"] == "silent"]
    (lost,) = [e for e in events if e["event"] == "lost"]
    assert silent["member"] == lost["member"] == "w2" and lost["exit_code"] == -9
    (recovery,) = [e for e in switches(events) if e["lost"]]
    assert recovery["result"] == "committed" and recovery["step"] == 10
    assert_same_training("tiny", events)
