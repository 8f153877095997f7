"""A job driven through the API as the operator drives it, with real agent processes.

`test_a_job_grows_shrinks_aborts_checkpoints_and_drains` starts 4 agent processes (a0..a3) and
drives one job through: a first world of 2 members, a grow to 4 (2 standing-by agents join), a
shrink to 2 members with tp=2 (2 leave), an aborted reconfiguration, a checkpoint, the drain of a
member that received SIGTERM, and a member killed outright, recovered from; releases end the agents.
`test_a_one_member_job_trains_to_its_end` starts 1 agent process: a job of a few steps.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("torch", reason="the agent needs torch (the agent extra)")

from torch.distributed import TCPStore

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.vps.hf import HfModel

from .agents import CONFIG, HOST, WAIT, Agent, Phase, agents, free_port, layout

Code = grpc.StatusCode
# The PYTHONPATH of an agent process that injects the faults its environment names (`inject`).
INJECTING = os.pathsep.join([str(Path(__file__).parent / "inject"), str(Path(__file__).parents[3]),
                             os.environ.get("PYTHONPATH", "")])  # fmt: skip


class Statuses:
    """Every status an agent's status stream shows, collected in a thread."""

    def __init__(self, agent: Agent) -> None:
        self.seen: list[pb.AgentStatus] = []
        self.stream = agent.call("WatchStatus", pb.WatchStatusRequest(), timeout=None)
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            for status in self.stream:
                self.seen.append(status)
        except grpc.RpcError:
            pass  # cancelled at the end

    def stop(self) -> list[pb.AgentStatus]:
        self.stream.cancel()
        self.thread.join(10)
        return self.seen


def host_store(agent: Agent, epoch: int) -> pb.StoreAddress:
    address = agent.call("HostStore", pb.HostStoreRequest(epoch=epoch)).address
    assert address.host == "127.0.0.1" and address.port > 0
    # Asked again (an operator that restarted), the same store.
    assert agent.call("HostStore", pb.HostStoreRequest(epoch=epoch)).address == address
    return address


def change(
    epoch: int, store: pb.StoreAddress, old: pb.Layout, new: pb.Layout, at_step: int = 0
) -> pb.PrepareRequest:
    request = pb.PrepareRequest(epoch=epoch, store=store, to=new, at_step=at_step)
    getattr(request, "from").CopyFrom(old)  # `from` is a Python keyword
    return request


def prepare(to: list[Agent], request: pb.PrepareRequest) -> None:
    for agent in to:
        agent.call("Prepare", request)


def switched(
    agents_: list[Agent], epoch: int, result: int = pb.SwitchSummary.COMMITTED
) -> list[pb.AgentStatus]:
    out = []
    for agent in agents_:
        status = agent.wait_for(
            f"the switch of epoch {epoch}",
            lambda s: s.last_switch.epoch == epoch and s.last_switch.result != 0,
        )
        assert status.last_switch.result == result, status
        out.append(status)
    return out


def trains(agent: Agent, past: int) -> pb.AgentStatus:
    return agent.wait_for(f"training past step {past}",
                          lambda s: s.phase == Phase.TRAINING and s.step > past)  # fmt: skip


@pytest.fixture
def four(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    with agents(["a0", "a1", "a2", "a3"], tmp_path) as started:
        yield started


def test_a_job_grows_shrinks_aborts_checkpoints_and_drains(
    tmp_path: Path, four: dict[str, Agent]
) -> None:
    """4 agent processes (a0..a3), driven as the operator drives a job."""
    a0, a1, a2, a3 = (four[n] for n in ("a0", "a1", "a2", "a3"))

    # The first world: a0 hosts its store; a0 and a1 train; a2 and a3 stand by, pre-warmed.
    first = layout(["a0", "a1"], dp=2)
    prepare([a0, a1], pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=first))
    prepare([a0], pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=first))  # a replay: OK
    for agent in (a0, a1):
        status = trains(agent, 2)
        assert status.epoch == 0 and status.layout == first and status.ready
    # The operator's request leaves the layout out, and only the layout.
    brief = a0.call("GetStatus", pb.GetStatusRequest(omit_layout=True))
    assert not brief.HasField("layout") and (brief.epoch, brief.phase) == (0, Phase.TRAINING)
    assert a2.status().phase == Phase.STANDBY
    steps = Statuses(a0)

    # Grow to 4: prepared while training, held, then released to switch at an agreed step.
    grown = layout(["a0", "a1", "a2", "a3"], dp=4)
    grow = change(1, host_store(a0, 1), first, grown, at_step=-1)
    prepare([a0, a1, a2, a3], grow)
    assert a2.status().phase == Phase.JOINING
    err = a2.refused("Release", pb.ReleaseRequest())
    assert err.code() == Code.FAILED_PRECONDITION and "joining" in (err.details() or "")
    err = a0.refused("Prepare", pb.PrepareRequest(epoch=2, store=grow.store, to=grown))
    assert err.code() == Code.FAILED_PRECONDITION and "epoch 1 is pending" in str(err.details())
    for agent in (a0, a1, a2, a3):
        status = agent.wait_for("epoch 1 prepared",
                                lambda s: s.pending.state == pb.Pending.PREPARED)  # fmt: skip
        assert status.pending.epoch == 1 and status.pending.at_step == -1
    before = a0.status().step
    assert not a0.status().HasField("last_switch")  # held: nothing switched yet
    for agent in (a0, a1, a2, a3):
        agent.call("Switch", pb.SwitchRequest(epoch=1, at_step=0))
    for status in switched([a0, a1, a2, a3], 1):
        assert status.layout == grown and status.epoch == 1 and status.phase == Phase.TRAINING
        assert status.last_switch.step >= before and status.last_switch.network_bytes > 0
        assert status.last_switch.to == "dp=4,tp=1,pp=1,ep=1,zero=0,pp_layers=4"
    assert len({s.last_switch.step for s in switched([a0, a1, a2, a3], 1)}) == 1  # one step
    err = a1.refused("Release", pb.ReleaseRequest())
    assert err.code() == Code.FAILED_PRECONDITION and "member of the world in effect" in str(err)

    # Shrink to a0 and a2 with tp=2, switching as soon as all are prepared; a1 and a3 leave.
    shrunk = layout(["a0", "a2"], tp=2)
    shrink = change(2, host_store(a0, 2), grown, shrunk)
    prepare([a0, a1, a2, a3], shrink)
    switched([a0, a1, a2, a3], 2)
    for agent in (a0, a2):
        assert trains(agent, 0).layout == shrunk
    for agent in (a1, a3):  # left: standing by, showing the world in effect without them
        status = agent.status()
        assert (status.phase, status.epoch, status.layout) == (Phase.STANDBY, 2, shrunk)

    # A standing-by agent is released and exits; a member is not.
    a3.call("Release", pb.ReleaseRequest())
    assert a3.wait_exit() == 0
    err = a0.refused("Release", pb.ReleaseRequest())
    assert err.code() == Code.FAILED_PRECONDITION

    # A reconfiguration given up before its switch: the job keeps its layout.
    three = layout(["a0", "a2", "a1"], pp=3)
    attempt = change(3, host_store(a0, 3), shrunk, three, at_step=-1)
    prepare([a0, a2, a1], attempt)
    a0.call("Abort", pb.AbortRequest(epoch=3))  # answered once a0 dropped it
    a0.call("Abort", pb.AbortRequest(epoch=3))  # again: already done
    for agent in (a2, a1):  # answered once queued; each drops it at its next boundary
        agent.call("Abort", pb.AbortRequest(epoch=3, queue_only=True))
        status = agent.status()  # until then, its status says so
        assert not status.HasField("pending") or status.pending.dropping, status
    for status in switched([a0, a2], 3, pb.SwitchSummary.ABORTED):
        assert status.epoch == 2 and status.layout == shrunk and not status.HasField("pending")
    assert a1.wait_for("no pending", lambda s: not s.HasField("pending")).phase == Phase.STANDBY
    err = a0.refused("Prepare", attempt)
    assert err.code() == Code.INVALID_ARGUMENT and "epoch=3 was used before" in str(err)
    trains(a0, a0.status().step)

    # A checkpoint, agreed by both members, exported by the first.
    path, out = str(tmp_path / "ckpt-1"), str(tmp_path / "hf")
    for agent in (a0, a2):
        request = pb.CheckpointRequest(number=1, path=path, at_step=0, export_to=out)
        agent.call("Checkpoint", request)
    for agent in (a0, a2):
        status = agent.wait_for("checkpoint 1", lambda s: s.last_checkpoint.number == 1)
        assert status.last_checkpoint.path == path and status.last_checkpoint.step > 0
        assert not status.last_checkpoint.export_error
    assert [a.status().last_checkpoint.exported_to for a in (a0, a2)] == [out, ""]
    assert HfModel.load(out).has_weights
    saved = json.loads((tmp_path / "ckpt-1" / "liveshard.json").read_text())
    assert saved["members"] == ["a0", "a2"] and saved["scalars"]["step"] > 0
    err = a0.refused("Checkpoint", pb.CheckpointRequest(number=1, path=path))
    assert err.code() == Code.INVALID_ARGUMENT and "greater than 1" in str(err)
    # A member of the world in effect is released only once its state is saved (a suspension).
    err = a0.refused("Release", pb.ReleaseRequest(saved=2))
    assert err.code() == Code.FAILED_PRECONDITION and "its last checkpoint is 1" in str(err)

    # Drain: a2 gets SIGTERM, keeps serving and training; its state moves to a1 (brought back
    # from standby), and then it is released.
    a2.signal()
    status = a2.wait_for("terminating", lambda s: s.terminating)
    assert trains(a2, status.step).phase == Phase.TRAINING
    err = a2.refused("HostStore", pb.HostStoreRequest(epoch=4))
    assert err.code() == Code.FAILED_PRECONDITION and "terminating" in str(err)
    drained = layout(["a0", "a1"], dp=2)
    drain = change(4, host_store(a0, 4), shrunk, drained)
    rejoined = Statuses(a1)
    prepare([a0, a2, a1], drain)
    switched([a0, a2, a1], 4)
    assert a2.status().phase == Phase.STANDBY and a2.proc.poll() is None  # still up
    a2.call("Release", pb.ReleaseRequest())
    assert a2.wait_exit() == 0
    for agent in (a0, a1):
        assert trains(agent, agent.status().step).layout == drained
    # a1 trained in epoch 1: back in a world, it shows no loss until it trains a step there.
    back = [s for s in rejoined.stop() if s.epoch == 4 and s.phase == Phase.TRAINING]
    switch_step = back[-1].last_switch.step
    assert {s.loss for s in back if s.step == switch_step} <= {0.0}
    assert all(s.loss > 0 for s in back if s.step > switch_step)

    # Through it all, a0's step never went back and its epoch only rose.
    seen = [(s.epoch, s.step) for s in steps.stop()]
    assert len(seen) > 10
    assert seen == sorted(seen), seen

    # A member that dies without warning breaks the world: the survivor reports BROKEN and why,
    # keeps its state, refuses anything but a recovery, and recovers from its own copy, alone.
    a1.signal(signal.SIGKILL)
    status = a0.wait_for("broken", lambda s: s.phase == Phase.BROKEN)
    assert "the world broke at step" in status.message and status.ready
    stopped = status.step
    err = a0.refused("Checkpoint", pb.CheckpointRequest(number=2, path=path))
    assert err.code() == Code.FAILED_PRECONDITION and "BROKEN" in str(err.details())
    alone = layout(["a0"], dp=1)
    recovery = change(5, host_store(a0, 5), drained, alone)
    err = a0.refused("Prepare", recovery)
    assert err.code() == Code.FAILED_PRECONDITION and "only a recovery" in str(err.details())
    recovery.lost.append("a1")
    prepare([a0], recovery)
    (status,) = switched([a0], 5)
    assert status.last_switch.step == stopped and status.last_switch.network_bytes == 0
    assert trains(a0, stopped).layout == alone
    # Its state saved in checkpoint 1 (a suspension), the member of the world is let go.
    a0.call("Release", pb.ReleaseRequest(saved=1))
    assert a0.wait_exit() == 0


def test_a_one_member_job_trains_to_its_end(tmp_path: Path) -> None:
    """1 agent process: a job of 6 steps runs to DONE, and the agent exits when released."""
    config = {**CONFIG, "training": {**CONFIG["training"], "steps": 6},  # type: ignore[dict-item]
              "rebalance": {"window_steps": 4}}  # fmt: skip
    with agents(["solo"], tmp_path, LIVESHARD_CONFIG=json.dumps(config)) as started:
        solo = started["solo"]
        request = pb.PrepareRequest(epoch=0, store=host_store(solo, 0), to=layout(["solo"]))
        solo.call("Prepare", request)
        err = solo.refused("Prepare", pb.PrepareRequest(epoch=1, store=request.store,
                                                        to=layout(["solo"])))  # fmt: skip
        assert err.code() == Code.FAILED_PRECONDITION
        status = solo.wait_for("the end", lambda s: s.phase == Phase.DONE)
        assert status.step == status.steps == 6 and status.samples == 6 * 4
        # Its state, held once (one member: nothing to mirror).
        assert status.state_bytes > 0 and status.mirrored_bytes == 0 == status.exchange_seconds
        # The measured costs: the medians of the last 4 steps, one stage holding every layer.
        costs = status.costs
        assert costs.steps == 4 and len(costs.layer_seconds) == 4 and costs.imbalance == 1.0
        whole = sum(costs.layer_seconds) + costs.first_seconds + costs.last_seconds
        assert list(costs.stage_seconds) == [pytest.approx(whole)] and whole > 0
        # Done, it keeps its state: a checkpoint of the last step is saved (and exported) at once.
        path, out = str(tmp_path / "last"), str(tmp_path / "hf")
        late = pb.CheckpointRequest(number=1, path=path, at_step=7, export_to=out)
        err = solo.refused("Checkpoint", late)
        assert err.code() == Code.INVALID_ARGUMENT and "past the job's last step" in str(err)
        solo.call("Checkpoint", pb.CheckpointRequest(number=1, path=path, at_step=6, export_to=out))
        saved = solo.wait_for("the checkpoint", lambda s: s.last_checkpoint.number == 1)
        assert saved.last_checkpoint.step == 6 and saved.last_checkpoint.exported_to == out
        assert saved.phase == Phase.DONE and HfModel.load(out).has_weights
        solo.call("Release", pb.ReleaseRequest())
        assert solo.wait_exit() == 0


def test_the_agents_of_a_deleted_job_are_discarded_whatever_they_do(tmp_path: Path) -> None:
    """2 agent processes training, told their pods are going (SIGTERM), then that their job is
    gone (`discard`), which a member of the world in effect takes though a plain Release is
    refused. a0, whose peer is stopped (SIGSTOP) so that its collective waits for an op deadline
    of 45 s (longer than the 10 s its step is watched plus the 5 s a discarded agent gives its
    member), exits a few seconds after its answer; a1, let go on, finds its world broken and
    exits at once."""
    config = {**CONFIG, "deadlines": {"op": 45, "switch": 180, "prepare": 180}}
    with agents(["a0", "a1"], tmp_path, LIVESHARD_CONFIG=json.dumps(config)) as started:
        a0, a1 = started["a0"], started["a1"]
        world = layout(["a0", "a1"], dp=2)
        prepare([a0, a1], pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=world))
        for agent in (a0, a1):
            trains(agent, 2)
            agent.signal()
            agent.wait_for("terminating", lambda s: s.terminating)
        err = a0.refused("Release", pb.ReleaseRequest())
        assert err.code() == Code.FAILED_PRECONDITION and "member of the world" in str(err)
        a1.signal(signal.SIGSTOP)
        # a0 may still finish a step a1 had done its part of (seconds, on a loaded machine); then
        # it waits in the next one: its step stays put for as long as the op deadline.
        step, since = a0.status().step, time.monotonic()
        while time.monotonic() - since < 10:
            time.sleep(1)
            now = a0.status().step
            if now != step:
                step, since = now, time.monotonic()
        a0.call("Release", pb.ReleaseRequest(discard=True))
        assert a0.wait_exit(timeout=60) == 0
        assert "did not stop within" in a0.output()
        a1.signal(signal.SIGCONT)
        # Let go on, a1 finds its world broken (its peer has gone) and stops training: at once
        # when its collective sees the closed connection, at the latest at its op deadline.
        a1.wait_for("its world broken", lambda s: s.phase == Phase.BROKEN, timeout=45 + WAIT)
        a1.call("Release", pb.ReleaseRequest(discard=True))
        assert a1.wait_exit() == 0
        assert "did not stop within" not in a1.output()


def test_a_joining_member_whose_store_dies_gives_the_change_up(tmp_path: Path) -> None:
    """3 agent processes: a1 waits to join a0's world through a store a2 hosts; a2 is killed.
    a1 gives the change up and stands by, alive, for the next one."""
    with agents(["a0", "a1", "a2"], tmp_path) as started:
        a0, a1, a2 = (started[n] for n in ("a0", "a1", "a2"))
        first = layout(["a0"])
        a0.call("Prepare", pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=first))
        trains(a0, 1)
        grow = change(1, host_store(a2, 1), first, layout(["a0", "a1"], dp=2), at_step=-1)
        prepare([a0, a1], grow)  # held: a1 joins once the switch is let go, never here
        a1.wait_for("epoch 1 prepared", lambda s: s.pending.state == pb.Pending.PREPARED)
        a2.signal(signal.SIGKILL)
        status = a1.wait_for("epoch 1 given up", lambda s: s.last_switch.epoch == 1)
        assert status.last_switch.result == pb.SwitchSummary.ABORTED
        assert "the store of epoch 1 failed" in status.last_switch.reason
        assert status.phase == Phase.STANDBY and not status.HasField("pending")


def test_a_member_waiting_to_join_a_change_given_up_untold_takes_the_next(tmp_path: Path) -> None:
    """2 agent processes: a1 is asked to join a0's world in epoch 1, which a0 never is (an
    operator gave it up and its Abort to a1 was lost): epoch 2, asked of both, supersedes it at
    a1 and commits. A member that trains still refuses a change while another is pending."""
    with agents(["a0", "a1"], tmp_path) as started:
        a0, a1 = started["a0"], started["a1"]
        first = layout(["a0"])
        a0.call("Prepare", pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=first))
        trains(a0, 1)
        grown = layout(["a0", "a1"], dp=2)
        # Epoch 1's store on a1: a0 frees its stores of epochs it has no part in when asked for
        # epoch 2's, which a1 could still be connecting to (then it never has epoch 1 to drop).
        a1.call("Prepare", change(1, host_store(a1, 1), first, grown, at_step=-1))
        assert a1.status().pending.epoch == 1  # preparing: a0 never comes
        prepare([a0, a1], change(2, host_store(a0, 2), first, grown, at_step=-1))
        status = a1.wait_for("epoch 1 given up", lambda s: s.last_switch.epoch == 1)
        assert status.last_switch.result == pb.SwitchSummary.ABORTED
        assert "superseded by epoch 2" in status.last_switch.reason
        err = a0.refused("Prepare", change(3, host_store(a0, 3), first, grown, at_step=-1))
        assert err.code() == Code.FAILED_PRECONDITION and "epoch 2 is pending" in str(err.details())
        for agent in (a0, a1):
            agent.wait_for("epoch 2 prepared", lambda s: s.pending.state == pb.Pending.PREPARED)
            agent.call("Switch", pb.SwitchRequest(epoch=2, at_step=0))
        for status in switched([a0, a1], 2):
            assert status.layout == grown and status.phase == Phase.TRAINING


def test_a_world_broken_everywhere_without_a_death_is_rebuilt_in_its_layout(
    tmp_path: Path,
) -> None:
    """2 agent processes: a1 stops (SIGSTOP) past the op deadline, so a0's world breaks; it
    resumes and finds its world broken too. Nobody died: the same layout is prepared again (no
    member lost), and both train on from the step they stopped at."""
    config = {**CONFIG, "deadlines": {"op": 5, "switch": 10, "prepare": 60}}
    with agents(["a0", "a1"], tmp_path, LIVESHARD_CONFIG=json.dumps(config)) as started:
        a0, a1 = started["a0"], started["a1"]
        pair = layout(["a0", "a1"], dp=2)
        prepare([a0, a1], pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=pair))
        trains(a0, 2)
        a1.signal(signal.SIGSTOP)
        stopped = a0.wait_for("broken", lambda s: s.phase == Phase.BROKEN).step
        a1.signal(signal.SIGCONT)
        assert a1.wait_for("broken", lambda s: s.phase == Phase.BROKEN).step == stopped
        moved = change(1, host_store(a0, 1), pair, layout(["a0", "a1"], tp=2))
        err = a0.refused("Prepare", moved)
        assert err.code() == Code.FAILED_PRECONDITION and "only a recovery" in str(err.details())
        prepare([a0, a1], change(1, host_store(a0, 1), pair, pair))
        for status in switched([a0, a1], 1):
            assert status.last_switch.step == stopped and status.last_switch.network_bytes == 0
        assert trains(a1, stopped).layout == pair


def test_a_member_trains_on_while_it_connects_to_a_changes_store(tmp_path: Path) -> None:
    """2 agent processes: a0 trains alone; a grow to a0 and a1 (tp=2 mirrored: each holds its
    peer's boxes too) names a store that nothing serves yet. a0 steps on while it connects; once
    the store is served, the grow is made, and each member exchanges gradients with its peer."""
    with agents(["a0", "a1"], tmp_path) as started:
        a0, a1 = started["a0"], started["a1"]
        alone = layout(["a0"])
        a0.call("Prepare", pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=alone))
        trains(a0, 1)
        grow = change(1, pb.StoreAddress(host=HOST, port=free_port()), alone,
                      layout(["a0", "a1"], tp=2, mirror=True))  # fmt: skip
        prepare([a0, a1], grow)
        before = a0.status().step
        status = trains(a0, before + 3)  # the change shows as preparing meanwhile
        assert status.epoch == 0 and status.pending.state == pb.Pending.PREPARING
        served = TCPStore(HOST, grow.store.port, None, True, wait_for_workers=False)
        for status in switched([a0, a1], 1):
            assert status.layout == grow.to and status.last_switch.step > before + 3
        for agent in (a0, a1):
            status = trains(agent, agent.status().step)
            assert status.exchange_seconds > 0 and status.mirrored_bytes > 0
        del served


@pytest.mark.parametrize("losing", ["a1", "a0,a1"], ids=["a0 read the commit", "none read it"])
def test_members_that_cannot_read_the_decision_wait_undecided_and_do_as_told(
    tmp_path: Path, losing: str
) -> None:
    """2 agent processes: a grow from a0 to a0 and a1, whose store fails under `losing` after the
    vote (injected). They show the change UNDECIDED and wait; told as the operator tells them
    (Switch when a member trains in the epoch, else Abort), they end where the others did."""
    with agents(["a0", "a1"], tmp_path, PYTHONPATH=INJECTING,
                TEST_LOSE_THE_DECISION=losing) as started:  # fmt: skip
        a0, a1 = started["a0"], started["a1"]
        alone = layout(["a0"])
        a0.call("Prepare", pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=alone))
        trains(a0, 1)
        grow = change(1, host_store(a0, 1), alone, layout(["a0", "a1"], dp=2))
        prepare([a0, a1], grow)
        undecided = [a for a in (a0, a1) if a.member in losing.split(",")]
        for agent in undecided:
            status = agent.wait_for(
                "epoch 1 undecided", lambda s: s.pending.state == pb.Pending.UNDECIDED
            )
            assert status.pending.epoch == 1 and "undecided" in status.message
        if a0 not in undecided:
            a0.wait_for("training in epoch 1", lambda s: s.epoch == 1)
            a1.call("Switch", pb.SwitchRequest(epoch=1))
            for status in switched([a0, a1], 1):
                assert status.layout == grow.to
            assert trains(a1, a0.status().step).layout == grow.to
        else:
            for agent in undecided:
                agent.call("Abort", pb.AbortRequest(epoch=1))
            for status in switched([a0, a1], 1, pb.SwitchSummary.ABORTED):
                assert "aborted as told" in status.last_switch.reason
            assert trains(a0, a0.status().step).epoch == 0
            assert a1.status().phase == Phase.STANDBY


def test_commands_obeyed_before_their_calls_answer_leave_nothing_pending(tmp_path: Path) -> None:
    """2 agent processes whose member's loop obeys every command before the call that gave it
    goes on (injected: the handler's thread kept off the CPU meanwhile). A first world, a grow,
    a checkpoint and a shrink are each taken and done before their calls answer; none stays
    pending, so each next command is accepted."""
    with agents(["a0", "a1"], tmp_path, PYTHONPATH=INJECTING,
                TEST_SETTLE_BEFORE_ANSWERING=1) as started:  # fmt: skip
        a0, a1 = started["a0"], started["a1"]
        alone = layout(["a0"])
        a0.call("Prepare", pb.PrepareRequest(epoch=0, store=host_store(a0, 0), to=alone))
        status = trains(a0, 1)
        assert not status.HasField("pending"), status
        grow = change(1, host_store(a0, 1), alone, layout(["a0", "a1"], dp=2))
        prepare([a0, a1], grow)
        for status in switched([a0, a1], 1):
            assert status.layout == grow.to
        for agent in (a0, a1):
            status = trains(agent, agent.status().step)
            assert status.epoch == 1 and not status.HasField("pending"), status
        path = str(tmp_path / "saved")
        at = a0.status().step + 2
        for agent in (a0, a1):
            agent.call("Checkpoint", pb.CheckpointRequest(number=1, path=path, at_step=at))
        saved = [a.wait_for("checkpoint 1", lambda s: s.last_checkpoint.number == 1).last_checkpoint
                 for a in (a0, a1)]  # fmt: skip
        assert saved[0].step == saved[1].step >= at
        shrink = change(2, host_store(a0, 2), grow.to, alone)
        prepare([a0, a1], shrink)
        switched([a0, a1], 2)
        assert trains(a0, a0.status().step).layout == alone
        assert a1.status().phase == Phase.STANDBY
