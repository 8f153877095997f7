"""The fault matrix on local jobs: a member killed (or stopped) at each point of a switch, and a
vote whose all-reduce completes at some members only. Whatever fails where, every surviving
member ends in one layout at one step with an exact state, and the job trains on: the losses
equal a one-process run's and every sample is fed once (`assert_same_training`).

A switch's decision is recorded once in the store (`engine.vote.settle`): a member dying before
the decision aborts the switch everywhere, one dying after it leaves the others committed and is
recovered from in the new layout. What members act on in the store is sealed with the job's
secret (`engine.sealed`): a process without it can neither abort a switch nor steer one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from torch.distributed import TCPStore

from liveshard_agent.engine import keys
from liveshard_agent.local.launcher import Driver, Fault, parse_kill, run_job
from liveshard_agent.local.output import Line
from liveshard_agent.runtime.trainer import Scalars
from liveshard_core.job import Deadlines
from tests.agent.runtime.faults import cannot_read_the_decision, loses_the_vote, slow_prepare
from tests.agent.runtime.test_training import STEPS, assert_same_training, job, switches

FROM, TO = "tp=2,dp=2", "pp=2,dp=2"  # every member sends and receives in this switch
OLD, NEW = "dp=2,tp=2,pp=1,ep=1,zero=0", "dp=2,tp=1,pp=2,ep=1,zero=0"
# Where the job recovers. (A death inside the transfer is the engine's `test_switch` case.)
AFTER = {"prepare": OLD, "vote": OLD, "commit": NEW}


def assert_found_at_once(events: list[dict[str, Any]]) -> None:
    """No survivor's world broke at a collective's timeout: a member whose all-reduce closing a
    switch failed closes its world, so the members still waiting in it fail at once (on a
    pipeline, one that trained on would otherwise wait for stage inputs while they wait for it,
    both until the op deadline)."""
    timed_out = re.compile("timed out|timeout", re.IGNORECASE)  # gloo's words for it
    slow = [e["reason"] for e in events if e["event"] == "broken" and timed_out.search(e["reason"])]
    assert not slow, slow


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
    assert_found_at_once(events)
    assert_same_training("tiny", events)


@pytest.mark.parametrize("phase", ["vote", "commit"])
def test_a_member_killed_inside_a_switch_of_mirrored_zero_layouts_is_recovered_in_memory(
    phase: str,
) -> None:
    # Mirrored ZeRO-1 with tp to mirrored ZeRO-3 with pp: every shard, old and new, has two
    # holders, so the dead member's state is in memory on either side of the decision.
    old, new = "dp=2,tp=2,pp=1,ep=1,zero=1", "dp=2,tp=1,pp=2,ep=1,zero=3"
    scripted = "10:pp=2,dp=2,zero=3,mirror=1"
    kill = parse_kill(f"10:1:{phase}")
    events = run_job(job("tiny", "tp=2,dp=2,zero=1,mirror=1", scripted, kills=(kill,)))
    (recovery,) = [e for e in switches(events) if e["lost"]]
    assert recovery["result"] == "committed", recovery
    assert recovery["to"].endswith(",mirror=1")
    assert short(recovery["from"]) == short(recovery["to"]) == (new if phase == "commit" else old)
    assert layouts(events)[-1] == new
    assert not [e for e in events if e["event"] == "restored"]
    assert_found_at_once(events)
    assert_same_training("tiny", events)


# Before the decision, in mirrored layouts: peers without replicas (tp=2,pp=2,zero=3), and
# mirrored ZeRO-1 (dp=4). The switch aborts everywhere and the dead member's bytes come from their
# other holder, in the old layout; the scripted switch then commits.
BEFORE_THE_VOTE = {
    "prepare": ("tp=2,pp=2,zero=3,mirror=1", "10:pp=4,mirror=1", "10:2:prepare",
                "dp=1,tp=1,pp=4,ep=1,zero=0"),
    "vote": ("tp=2,pp=2,zero=3,mirror=1", "10:pp=4,mirror=1", "10:3:vote",
             "dp=1,tp=1,pp=4,ep=1,zero=0"),
    "transfer": ("dp=4,zero=1,mirror=1", "10:pp=2,dp=2,zero=1,mirror=1", "10:1:transfer",
                 "dp=2,tp=1,pp=2,ep=1,zero=1"),
}  # fmt: skip


@pytest.mark.parametrize("phase", list(BEFORE_THE_VOTE))
def test_a_member_killed_before_a_mirrored_switch_votes_is_recovered_in_memory(phase: str) -> None:
    layout, scripted, kill, new = BEFORE_THE_VOTE[phase]
    events = run_job(job("tiny", layout, scripted, kills=(parse_kill(kill),)))
    (recovery,) = [e for e in switches(events) if e["lost"]]
    assert recovery["result"] == "committed", recovery
    assert short(recovery["from"]) == short(recovery["to"]) == layouts(events)[0]
    assert recovery["to"].endswith(",mirror=1")
    assert layouts(events)[-1] == new
    assert not [e for e in events if e["event"] == "restored"]
    assert_found_at_once(events)
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


@pytest.mark.parametrize(
    "losing", [("w1",), ("w0", "w1", "w2", "w3")], ids=["one read the commit", "none read it"]
)
def test_members_that_cannot_read_the_decision_are_told_it_and_never_split(
    losing: tuple[str, ...],
) -> None:
    # The store fails under `losing` after their vote, before they read the decision: they are
    # undecided, keep both states, and the launcher (which hosts the store) tells them the one
    # recorded: the others' commit, or, when no member recorded one, an abort.
    hooks = partial(cannot_read_the_decision, losing, 1.0)
    events = run_job(job("tiny", "dp=4", f"10:{FROM}", hooks=hooks))
    (switch,) = switches(events)
    if len(losing) == 1:
        assert switch["result"] == "committed"
        assert layouts(events) == ["dp=4,tp=1,pp=1,ep=1,zero=0", OLD]
    else:
        assert (switch["result"], switch["cause"]) == ("aborted", "vote_incomplete")
        assert "aborted as told" in switch["reason"]
        assert layouts(events) == ["dp=4,tp=1,pp=1,ep=1,zero=0"]
    assert_same_training("tiny", events)


def test_members_whose_collective_fails_only_at_its_timeout_are_not_taken_for_silent() -> None:
    # Rank 0 dies inside the commit of dp=4 -> tp=2,dp=2: w1 sees it at once, but w2 and w3
    # learn it only when their next collective times out, an op deadline after they entered it.
    # They are alive and keep their state: none may be killed as silent.
    dying = job("tiny", "dp=4", "10:tp=2,dp=2", kills=(parse_kill("10:0:commit"),))
    fast = Deadlines(op=5, switch=10, prepare=30)
    events = run_job(replace(dying, config=replace(dying.config, deadlines=fast)))
    assert [e for e in events if e["event"] == "silent"] == []
    (lost,) = [e for e in events if e["event"] == "lost"]
    assert lost["member"] == "w0"
    (recovery,) = [e for e in switches(events) if e["lost"]]
    assert recovery["result"] == "committed" and recovery["lost"] == ["w0"]
    # w0 was to speak for the new world: another member's account of the switch is its line.
    (switch,) = [e for e in switches(events) if not e["lost"]]
    assert (switch["epoch"], switch["result"], switch["step"]) == (1, "committed", 10)
    assert_same_training("tiny", events)


def test_a_stopped_member_is_found_silent_killed_and_replaced() -> None:
    stopping = job("tiny", "dp=4", kills=(parse_kill("10:2", Fault.HANG),))
    fast = Deadlines(op=5, switch=10, prepare=30)
    events = run_job(replace(stopping, config=replace(stopping.config, deadlines=fast)))
    (silent,) = [e for e in events if e["event"] == "silent"]
    (lost,) = [e for e in events if e["event"] == "lost"]
    assert silent["member"] == lost["member"] == "w2" and lost["exit_code"] == -9
    (recovery,) = [e for e in switches(events) if e["lost"]]
    assert recovery["result"] == "committed" and recovery["step"] == 10
    assert_same_training("tiny", events)


def test_a_switch_asked_while_the_new_world_breaks_is_made_after_the_recovery() -> None:
    # w1 stops right after the vote of dp=4 -> tp=2,dp=2: the others commit, and their closing
    # collectives in the new world wait out the op deadline. A member's account of the commit
    # comes before its break, so the next scripted switch can reach members that take only a
    # recovery: their refusal aborts it, and it is asked again once w1 is found silent and the
    # job recovered without it.
    stopping = job("tiny", "dp=4", "10:tp=2,dp=2", "12:dp=3",
                   kills=(parse_kill("10:1:commit", Fault.HANG),))  # fmt: skip
    fast = Deadlines(op=5, switch=10, prepare=30)
    events = run_job(replace(stopping, config=replace(stopping.config, deadlines=fast)))
    (silent,) = [e for e in events if e["event"] == "silent"]
    assert silent["member"] == "w1"
    first, recovery, scripted = [e for e in switches(events) if e["result"] == "committed"]
    assert (first["epoch"], first["step"], short(first["to"])) == (
        1,
        10,
        "dp=2,tp=2,pp=1,ep=1,zero=0",
    )
    assert recovery["lost"] == ["w1"] and recovery["step"] == 10
    assert short(scripted["to"]) == "dp=3,tp=1,pp=1,ep=1,zero=0" and scripted["step"] >= 12
    assert_same_training("tiny", events)


def test_a_shrink_whose_speaker_stops_at_the_commit_recovers_without_its_leaving_members() -> None:
    # w0, which speaks for the new world, stops right after the vote of dp=4 -> dp=2: the
    # others commit, w2 and w3 leave (they say so and say nothing more) and w1's new world
    # breaks. The account that speaks for the commit never comes: w1's break says it committed,
    # so only w0 is found silent, and the job recovers without it, not without w2 and w3.
    stopping = job("tiny", "dp=4", "10:dp=2", kills=(parse_kill("10:0:commit", Fault.HANG),))
    fast = Deadlines(op=5, switch=10, prepare=30)
    events = run_job(replace(stopping, config=replace(stopping.config, deadlines=fast)))
    assert [e["member"] for e in events if e["event"] in ("silent", "lost")] == ["w0", "w0"]
    shrink, recovery = [e for e in switches(events) if e["result"] == "committed"]
    assert short(shrink["to"]) == "dp=2,tp=1,pp=1,ep=1,zero=0" and shrink["step"] == 10
    assert recovery["lost"] == ["w0"] and recovery["step"] == 10
    assert_same_training("tiny", events)


@pytest.mark.parametrize("phase", ["step", "update"])
def test_a_world_broken_everywhere_with_no_member_lost_is_rebuilt_in_its_layout(
    tmp_path: Path, phase: str
) -> None:
    # w1 sleeps past its peers' collective timeouts (a partition that heals, a slow member):
    # every member's world breaks, each keeps its state, nobody is silent long enough to be
    # killed; the launcher rebuilds the world in the same layout from the step they stopped at.
    # Step 9, trained again, asks again for the checkpoint due after it: the same request.
    # Or w1 sleeps after step 9's update: each member's sharing of it fails, its other rows stay
    # a step old, and the rebuilt world shares them again before step 10.
    stalling = job("tiny", "dp=2,zero=1", "12:pp=2",
                   kills=(parse_kill(f"9:1:{phase}", Fault.STALL),),
                   checkpoint_dir=str(tmp_path), checkpoint_every=5)  # fmt: skip
    fast = Deadlines(op=4, switch=10, prepare=30)
    events = run_job(replace(stalling, config=replace(stalling.config, deadlines=fast)))
    assert [e["event"] for e in events if e["event"] in ("lost", "silent", "restored")] == []
    assert {e["member"] for e in events if e["event"] == "broken"} == {"w0", "w1"}
    saved = [(e["step"], e["result"]) for e in events if e["event"] == "checkpoint"]
    # After the update, the boundary at step 10 is never reached: its checkpoint is made at 11.
    due = [step + (phase == "update" and step == 10) for step in range(5, STEPS + 1, 5)]
    assert saved == [(step, "saved") for step in due]
    # The scripted switch, prepared when the world broke, is given up and made after the rebuild.
    given_up, rebuild, scripted = switches(events)
    assert (given_up["result"], given_up["cause"]) == ("aborted", "peer_failed")
    at = 9 if phase == "step" else 10
    assert (rebuild["trigger"], rebuild["result"], rebuild["step"]) == ("rebuild", "committed", at)
    assert short(rebuild["from"]) == short(rebuild["to"]) == "dp=2,tp=1,pp=1,ep=1,zero=1"
    assert scripted["result"] == "committed" and scripted["step"] >= 12
    assert_same_training("tiny", events)


def test_a_switch_to_the_layout_in_effect_is_no_rebuild_and_waits_for_one() -> None:
    # The world breaks while a scripted switch to the same layout is pending: the rebuild
    # supersedes it, and it is made afterwards as scripted.
    stalling = job("tiny", "dp=2", "9:dp=2", kills=(parse_kill("7:1", Fault.STALL),))
    fast = Deadlines(op=4, switch=10, prepare=30)
    events = run_job(replace(stalling, config=replace(stalling.config, deadlines=fast)))
    given_up, rebuild, scripted = switches(events)
    assert (given_up["result"], given_up["cause"]) == ("aborted", "peer_failed")
    assert (rebuild["trigger"], rebuild["result"], rebuild["step"]) == ("rebuild", "committed", 7)
    assert (scripted["trigger"], scripted["result"]) == ("scripted", "committed")
    assert scripted["step"] >= 9
    assert_same_training("tiny", events)


def test_a_switch_the_job_ends_before_is_said_unmade() -> None:
    events = run_job(job("tiny", "dp=2", f"{STEPS - 2}:dp=1", hooks=partial(slow_prepare, 60)))
    assert switches(events) == []
    (unmade,) = [e for e in events if e["event"] == "unmade"]
    assert (unmade["step"], short(unmade["to"])) == (STEPS - 2, "dp=1,tp=1,pp=1,ep=1,zero=0")
    assert f"ended at step {STEPS - 1}" in unmade["reason"]


def test_a_process_without_the_job_secret_can_neither_abort_nor_steer_a_switch() -> None:
    """Before the job starts, a plain store client without the job's secret writes an abort at
    every key of the first three epochs it can name (their untagged names, and a guessed tag),
    and claims each epoch for every member; the test, which knows the secret, also puts values
    without the job's seal at the true keys of the first two switches: a raw abort decision
    (epoch 1), and an announcement to switch at step 0 sealed but with its MAC altered (epoch 2).
    Those two switches abort without acting on what the values say, naming the key; the third
    commits; the training is unchanged. Up to 3 processes (each switch adds a member)."""
    scripted = job("tiny", "dp=2", "8:dp=3", "16:dp=3", "24:dp=3")
    events: list[Line] = []
    driver = Driver(scripted, events.append)
    forger = TCPStore("127.0.0.1", driver.address.port, None, False, timedelta(seconds=10))
    abort = json.dumps({"cause": "vote_no", "reason": "forged", "abort": "forged"})
    for epoch in (1, 2, 3):
        for scope in (f"liveshard/{epoch}", f"liveshard/{epoch}/{secrets.token_hex(8)}"):
            forger.set(f"{scope}/decision", abort)
            forger.set(f"{scope}/announce", abort)
            forger.set(f"{scope}/digest/all", "1")
            for member in ("w0", "w1", "w2"):
                forger.add(f"{scope}/claimed/{member}", 1)
    seal = scripted.seal()
    decision, announcement = keys.decision(1, seal.tag(1)), keys.announcement(2, seal.tag(2))
    forger.set(decision, abort)
    steer = json.dumps({"step": 0, "scalars": Scalars(seed=1).as_dict()})
    mark, mac, payload = seal.seal(announcement, steer).split(":", 2)
    forger.set(announcement, f"{mark}:{mac[::-1]}:{payload}")
    driver.run()

    first, second, third = switches(events)
    assert [s["epoch"] for s in (first, second, third)] == [1, 2, 3]
    for aborted, key, why in (
        (first, decision, "is not sealed"),
        (second, announcement, "does not carry the job's seal"),
    ):
        assert aborted["result"] == "aborted" and aborted["step"] >= 8, aborted
        assert f"{key!r} in the job's store {why}" in aborted["reason"], aborted
        assert "forged" not in aborted["reason"]
    assert third["result"] == "committed", third
    assert third["checksums"]["before"] == third["checksums"]["after"]
    assert all(epoch == 3 for epoch in driver.accounts), driver.accounts  # the settled, dropped
    assert layouts(events) == ["dp=2,tp=1,pp=1,ep=1,zero=0", "dp=3,tp=1,pp=1,ep=1,zero=0"]
    assert_same_training("tiny", events)
