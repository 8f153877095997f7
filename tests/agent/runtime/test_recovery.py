"""Recovery from a member that dies without notice: local jobs of several processes (gloo, CPU).

A member kills its own process (SIGKILL) as it begins a step (`--kill STEP:RANK`; or after its
update, `STEP:RANK:update`); the others' world breaks in that step's first collective (or in
ZeRO-1's sharing of the update), and the launcher answers with a recovery: the same
layout, a new process in the dead member's place, the dead member `lost`. The job must train on
as if nothing happened: the losses equal a one-process run's step by step (within the
reduction-order tolerance of `test_training`), every sample is fed exactly once, and the step
that broke is trained once, after the recovery. Each job starts up to 6 processes.
"""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

import torch
from torch.distributed import TCPStore

from liveshard_agent.engine import keys
from liveshard_agent.engine.errors import ForgedValue
from liveshard_agent.engine.sealed import JobStore, Seal
from liveshard_agent.engine.world import World
from liveshard_agent.local.launcher import ScriptedKill, parse_kill, run_job
from liveshard_agent.runtime import optimizer as optimizer_module
from liveshard_agent.runtime.announcement import (
    AbortAnnounced,
    SwitchAnnounced,
    announce,
    announced,
)
from liveshard_agent.runtime.data import Dataset, load_corpus
from liveshard_agent.runtime.recovery import (
    Breakage,
    BreakReport,
    decide,
    publish,
    recovery_decision,
)
from liveshard_agent.runtime.trainer import Scalars, Trainer, initial_state
from liveshard_agent.runtime.weights import Peers
from liveshard_core.job import Cause, TrainingSettings
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.vps.presets import preset
from tests.agent.runtime.test_training import STEPS, assert_same_training, job, switches

SCENARIOS = {
    # name: (model, layout, kills, scripted switches)
    "dp, a member dies": ("tiny", "dp=4", ("10:1",), ()),
    "tp and dp, the first rank dies": ("tiny", "tp=2,dp=2", ("10:0",), ()),
    "pp, a last-stage member dies while a switch waits": ("tiny", "pp=2,dp=2", ("8:3",),
                                                          ("14:dp=4",)),
    "two members die at once": ("tiny", "dp=4", ("10:0", "10:3"), ()),
    "ep, experts from their other replica": ("tiny-moe", "dp=4,ep=2", ("5:2",), ("12:dp=4",)),
    # Mirrored ZeRO shards (`Layout.mirror`): a dead member's shard from the next of its group.
    "ZeRO-3 and tp mirrored, then a switch": ("tiny", "tp=2,dp=2,zero=3,mirror=1", ("6:0",),
                                              ("12:dp=4,zero=1,mirror=1",)),
    "two members die, each shard keeps a holder": ("tiny", "dp=4,zero=1,mirror=1",
                                                   ("6:0", "6:2"), ()),
    "expert shards mirrored in their expert-dp group": ("tiny-moe", "dp=4,ep=2,zero=1,mirror=1",
                                                        ("5:1",), ()),
    # No replicas (dp = 1, experts of ep = dp): the next member along dp, pp or tp holds each box
    # too, and updates it from the gradients its holder sends.
    "tp and pp without replicas, from the pp peer, then a switch": (
        "tiny", "tp=2,pp=2,zero=3,mirror=1", ("6:2",), ("12:pp=4,mirror=1",)),
    # A stage's whole tp group (a pod of two, with tp kept inside pods): from the next stage.
    "tp and pp without replicas, a stage's tp group dies": ("tiny", "tp=2,pp=2,mirror=1",
                                                            ("6:0", "6:1"), ()),
    "tp without replicas, from the tp peer": ("tiny", "tp=2,mirror=1", ("6:1",), ()),
    "pp without replicas, killed after its update": ("tiny", "pp=3,mirror=1", ("6:0:update",),
                                                     ()),
    "experts of ep = dp, from the next ep rank": ("tiny-moe", "dp=2,ep=2,zero=1,mirror=1",
                                                 ("5:1",), ()),
    # Killed between its update and ZeRO-1's sharing of it: every survivor holds the step in
    # its shards and the step before in the other rows; the recovery reads those from the shards.
    "ZeRO-1 mirrored, a member dies before sharing its update": (
        "tiny", "dp=4,zero=1,mirror=1", ("6:1:update",), ("12:pp=2,dp=2,zero=1,mirror=1",)),
}  # fmt: skip


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in switches(events) if e["lost"]]


def sends_to_a_peer(model: str, layout: str) -> bool:
    """Whether rank 0 of `layout` (a step line's) sends gradients to a peer every step."""
    spec, degrees = job(model, "dp=1").spec(), parse_degrees(layout)
    placed = degrees.layout(spec, [f"m{i}" for i in range(degrees.world_size)])
    return bool(Peers.build(spec, placed, 0).sends)


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
    # Rank 0's step line times its exchange with its peer, in the layouts that have one only.
    for layout in {e["layout"] for e in events if e["event"] == "step"}:
        timed = {e["exchange_seconds"] > 0 for e in events if e.get("layout") == layout}
        assert timed == {sends_to_a_peer(model, layout)}, layout
    assert_same_training(model, events)


def test_a_loss_without_a_surviving_copy_stops_a_job_that_saved_no_checkpoint() -> None:
    # ZeRO-1 on two members: each holds the only copy of half the optimizer state.
    with pytest.raises(RuntimeError, match=r"no surviving copy .* no checkpoint was saved"):
        run_job(job("tiny", "dp=2,zero=1", kills=(ScriptedKill(5, 1),)))


def test_a_mirrored_shard_whose_two_holders_die_at_once_has_no_surviving_copy() -> None:
    # dp=4 mirrored: shard 1 is held by members 1 and 2 only.
    with pytest.raises(RuntimeError, match=r"no surviving copy .* no checkpoint was saved"):
        run_job(job("tiny", "dp=4,zero=1,mirror=1", kills=(ScriptedKill(5, 1), ScriptedKill(5, 2))))


def test_a_loss_without_a_surviving_copy_restarts_from_the_last_checkpoint(tmp_path: Path) -> None:
    # ZeRO-1 and tp: the dead member's optimizer shard has no copy; the job saved at steps 4 and
    # 8, the member dies at step 10 while a scripted switch waits for step 12.
    events = run_job(job("tiny", "tp=2,dp=2,zero=1", "12:dp=4,zero=1",
                         kills=(ScriptedKill(10, 3),), checkpoint_dir=str(tmp_path),
                         checkpoint_every=4))  # fmt: skip
    (restored,) = [e for e in events if e["event"] == "restored"]
    assert restored["step"] == 8 and restored["path"] == str(tmp_path / "step-8")
    assert "no surviving copy" in restored["reason"], restored
    # Steps 8 and 9 are trained again, by fresh processes, in the same layout; then the
    # scripted switch, and the rest as if nothing happened.
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(10)) + list(range(8, STEPS))
    after = events[events.index(restored) + 1 :]
    later = [e for e in switches(after) if e["result"] == "committed"]
    assert [e["to"] for e in later] == ["dp=4,tp=1,pp=1,ep=1,zero=1,pp_layers=4"]
    # The retrained steps' lines stand for those the restart undid: the same losses as a
    # one-process run, every sample fed once.
    before = [e for e in events[: events.index(restored)] if e.get("step", 0) < 8]
    assert_same_training("tiny", before + after)


# ---- the first survivor's decision ----


def report(step: int, whole: bool = True, unfinished: bool = False) -> BreakReport:
    scalars = Scalars(step=step, adam_step=step, samples=step * 24, seed=0)
    return BreakReport(scalars, Breakage(step, whole, "test", unfinished), (4.0, 2.5, 0.0))


@pytest.mark.parametrize(
    ("reports", "why"),
    [
        ({"m0": report(7), "m2": report(7)}, None),
        ({"m0": report(7, unfinished=True), "m2": report(8)}, None),
        ({"m0": report(7), "m2": report(8)}, "steps {'m0': 7, 'm2': 8}, and ['m0'] cannot catch"),
        ({"m0": report(6, unfinished=True), "m2": report(8)}, "['m0'] cannot catch up"),
        ({"m0": report(7), "m2": report(7, whole=False)}, "middle of an update at ['m2']"),
    ],
)
def test_survivors_switch_at_their_last_step_or_learn_why_there_is_none(
    reports: dict[str, BreakReport], why: str | None
) -> None:
    decision = recovery_decision(reports)
    if why is None:
        assert isinstance(decision, SwitchAnnounced)
        last = max(r.breakage.step for r in reports.values())
        scalars = next(r.scalars for r in reports.values() if r.breakage.step == last)
        assert decision.step == last and decision.scalars == scalars
        behind = any(r.breakage.step < last for r in reports.values())
        assert decision.finish == ((4.0, 2.5, 0.0) if behind else None)
    else:
        assert isinstance(decision, AbortAnnounced)
        assert decision.cause is Cause.NO_COMMON_STATE
        assert why in decision.reason and "restore from a checkpoint" in decision.reason


SEAL = Seal.of("the job's token", "job")


def job_store() -> JobStore:
    raw = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    return JobStore(raw, SEAL)


def test_a_break_report_and_an_announcement_survive_the_store_unchanged() -> None:
    store = job_store()
    sent = report(7, unfinished=True)
    publish(store, 3, "m1", sent)
    assert BreakReport.from_json(store.get(keys.breakage(3, SEAL.tag(3), "m1"))) == sent
    assert announced(store, 3, wait=False) is None
    decision = SwitchAnnounced(8, sent.scalars, (4.0, 2.5, 0.0))
    announce(store, 3, decision)
    announce(store, 3, AbortAnnounced("too late: the first announcement stands"))
    assert announced(store, 3) == decision


def test_a_recovery_never_goes_on_from_reports_or_announcements_without_the_seal() -> None:
    """A process that reaches the store without the job's credential writes what would stop the
    recovery (reports of an update cut in half, an abort) where it can: at the keys' untagged
    names, and at a true key with another job's seal. Nothing of it is acted on."""
    store = job_store()
    raw, survivors, lie = store.store, ["m0", "m1"], report(7, whole=False)
    other = Seal.of("another job's token", "job")

    def forge(epoch: int) -> str:
        for member in survivors:
            raw.set(f"liveshard/{epoch}/broken/{member}", lie.to_json())
        raw.set(f"liveshard/{epoch}/announce", json.dumps({"abort": "forged"}))
        key = keys.breakage(epoch, SEAL.tag(epoch), "m1")
        raw.set(key, other.seal(key, lie.to_json()))
        return key

    def first_survivor_decides(epoch: int, broke_ago: float) -> None:
        decide(
            store, epoch=epoch, survivors=survivors, member="m0",
            broken_at=time.perf_counter() - broke_ago, deadline=30,
        )  # fmt: skip

    forge(4)
    publish(store, 4, "m0", report(7))
    first_survivor_decides(4, broke_ago=0)
    assert announced(store, 4, wait=False) is None  # m1's report is not sealed: not said yet
    publish(store, 4, "m1", report(7))  # m1's own replaces it
    first_survivor_decides(4, broke_ago=0)
    assert announced(store, 4) == SwitchAnnounced(7, report(7).scalars)

    # A report that stays unsealed until the deadline: the recovery aborts, naming its key.
    key = forge(5)
    publish(store, 5, "m0", report(7))
    first_survivor_decides(5, broke_ago=31)
    aborted = announced(store, 5)
    assert isinstance(aborted, AbortAnnounced) and aborted.cause is Cause.DEADLINE_PASSED
    assert "survivors ['m1'] did not say" in aborted.reason and key in aborted.reason

    # An announcement that is not sealed is refused, naming its key.
    key = keys.announcement(6, SEAL.tag(6))
    raw.set(key, json.dumps({"step": 7, "scalars": report(7).scalars.as_dict()}))
    with pytest.raises(ForgedValue, match=re.escape(key)):
        announced(store, 6)


# ---- an update cut in its all-reduce, finished alone ----


def one_member(store: TCPStore, epoch: int, zero: int = 0) -> Trainer:
    spec = preset("tiny")
    layout = Layout.create(spec, ["m0"], dp=1, zero=zero)
    device = torch.device("cpu")
    world = World.build(
        store, epoch=epoch, tag="test", layout=layout, member="m0", device=device, timeout=30
    )
    settings = TrainingSettings(steps=10)
    return Trainer(
        state=initial_state(spec, layout, 0, settings.seed, device), world=world,
        settings=settings, dataset=Dataset(load_corpus(None), settings.seq_len, settings.seed),
        scalars=Scalars(seed=settings.seed),
    )  # fmt: skip


@pytest.mark.parametrize("zero", [0, 1])
def test_an_update_cut_in_its_all_reduce_finishes_alone_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, zero: int
) -> None:
    """One process, two single-member trainers of the same job: `cut` has the update's last
    all-reduce fail (as when a peer dies inside it, which completes elsewhere), then finishes the
    update with the sums `whole` got; both states must then be the same, bit for bit (ZeRO-1 too:
    its sharing of the update follows in the recovery)."""
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    whole, cut = one_member(store, 0, zero), one_member(store, 1, zero)
    for trainer in (whole, cut):
        trainer.step()
    fail = {"now": False}
    all_reduce = optimizer_module.comm.all_reduce

    def failing(tensor: torch.Tensor, group: Any, *args: Any) -> None:
        if fail["now"] and tensor.dtype == torch.float64:
            raise RuntimeError("Connection closed by peer")
        all_reduce(tensor, group, *args)

    monkeypatch.setattr(optimizer_module.comm, "all_reduce", failing)
    whole.step()
    fail["now"] = True
    with pytest.raises(RuntimeError, match="closed by peer"):
        cut.step()
    fail["now"] = False
    assert cut.whole and cut.optimizer.can_finish and cut.scalars.step == 1
    cut.finish_step(whole.optimizer.summed)
    assert cut.scalars == whole.scalars
    for (ref, box, mine), (_, _, theirs) in zip(
        cut.state.items(), whole.state.items(), strict=True
    ):
        assert torch.equal(mine, theirs), (ref, box)
    assert cut.step().loss == whole.step().loss
