"""The job's checkpoints as the operator keeps them: the last one saved recorded in status and
used for a restore when no agent that saved it is left; a failed one reported once as a Warning
event, in the Degraded condition and in status until a later one is saved, and never asked
again in a loop. No cluster, no agent: the agents' statuses are the proto messages they send."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from liveshard_operator import render
from liveshard_operator.actions import Begin, Checkpoint, Event, EventType
from liveshard_operator.checkpoints import RETRY_SECONDS
from liveshard_operator.conditions import stamp
from liveshard_operator.decide import decide
from liveshard_operator.observation import Job
from liveshard_operator.world import Record, Suspension

from liveshard.v1 import agent_pb2 as pb
from tests.operator.values import NOW, broken, checkpoint, job, pod, seen, standby, training, world

M = render.MEMBER
PERIODIC = job(3, checkpoint={"path": "/ck", "everySteps": 5})
W3 = world(PERIODIC, ["p0", "p1", "p2"], 1)
SAVED = {"number": 2, "path": "/ck/step-10", "step": 10, "time": "2024-01-01T00:00:00Z"}
REASON = "checkpoint to /ck/step-15 failed: prepare: rank 0: OSError: [Errno 28] No space left"
FAILURE = f"checkpoint 3 of step 15 to /ck/step-15 failed: {REASON}"


def with_status(the_job: Job, **status: Any) -> Job:
    """`the_job` as read with `status` (what earlier passes wrote)."""
    return replace(the_job, body={**the_job.body, "status": status})


def failed(number: int, step: int, path: str, error: str) -> pb.CheckpointSummary:
    return pb.CheckpointSummary(number=number, step=step, path=path, error=error)


def members(step: int, **fields: Any) -> list[Any]:
    return [pod(m, training(1, step=step, **fields), role=M) for m in ("p0", "p1", "p2")]


def degraded(status: dict[str, Any]) -> tuple[str, str, str]:
    cond = next(c for c in status["conditions"] if c["type"] == "Degraded")
    return cond["status"], cond["reason"], cond["message"]


def test_the_last_checkpoint_saved_is_recorded_and_keeps_its_time() -> None:
    pods = seen(*members(12, last_checkpoint=checkpoint(2, 10, "/ck/step-10")))
    status = decide(pods, Record(world=W3, checkpoint_asked=2), PERIODIC, NOW).status
    assert status["lastCheckpoint"] == {**SAVED, "time": stamp(NOW)}
    kept = with_status(PERIODIC, lastCheckpoint=SAVED)
    assert decide(pods, Record(world=W3, checkpoint_asked=2), kept, NOW).status[
        "lastCheckpoint"
    ] == SAVED  # fmt: skip
    # A newer one replaces it; agents that never saw one (they joined since) leave it as it is.
    newer = seen(*members(17, last_checkpoint=checkpoint(3, 15, "/ck/step-15")))
    status = decide(newer, Record(world=W3, checkpoint_asked=3), kept, NOW).status
    assert status["lastCheckpoint"] == {"number": 3, "path": "/ck/step-15", "step": 15,
                                        "time": stamp(NOW)}  # fmt: skip
    fresh = decide(seen(*members(17)), Record(world=W3, checkpoint_asked=3), kept, NOW).status
    assert fresh["lastCheckpoint"] == SAVED and "checkpointFailure" not in fresh


def test_a_restore_with_no_agent_that_saved_it_left_uses_the_recorded_checkpoint() -> None:
    """Every member died: the pods that replace them stand by and know no checkpoint; the job
    restores the one its status recorded, not Failed."""
    kept = with_status(PERIODIC, lastCheckpoint=SAVED)
    owed = Record(world=W3, last_epoch=2, restore="the recovery from the loss of p0, p1, p2 "
                  "aborted: no surviving copy")  # fmt: skip
    pods = seen(*(pod(m, standby()) for m in ("p3", "p4", "p5")))
    decision = decide(pods, owed, kept, NOW)
    assert isinstance(decision.ask, Begin)
    assert decision.ask.plan.restore == "/ck/step-10"
    assert decision.ask.plan.reason.startswith("restore from /ck/step-10 (step 10): the recovery")
    assert decision.ask.plan.new.members == ("p3", "p4", "p5")
    # With no pod ready yet, it waits for them (pods are created), and fails nothing.
    waiting = decide(seen(), owed, kept, NOW)
    assert waiting.ask is None and waiting.status["phase"] != "Failed"
    assert "restoring /ck/step-10" in next(
        c["message"] for c in waiting.status["conditions"] if c["type"] == "Ready"
    )
    # Without a recorded one, and no agent that saved one: Failed, as before.
    none = decide(pods, owed, PERIODIC, NOW)
    assert none.status["phase"] == "Failed"


def test_a_newer_checkpoint_an_agent_reports_wins_over_the_recorded_one() -> None:
    kept = with_status(PERIODIC, lastCheckpoint=SAVED)
    owed = Record(world=W3, last_epoch=2, restore="the recovery aborted")
    pods = seen(pod("p0", broken(1, last_checkpoint=checkpoint(3, 15, "/ck/step-15")), role=M),
                pod("p3", standby()), pod("p4", standby()))  # fmt: skip
    decision = decide(pods, owed, kept, NOW)
    assert isinstance(decision.ask, Begin) and decision.ask.plan.restore == "/ck/step-15"


def test_a_failed_checkpoint_is_a_warning_event_once_and_degrades_the_job() -> None:
    pods = seen(*members(17, last_checkpoint=checkpoint(2, 10, "/ck/step-10"),
                        failed_checkpoint=failed(3, 15, "/ck/step-15", REASON)))  # fmt: skip
    record = Record(world=W3, checkpoint_asked=3)
    first = decide(pods, record, PERIODIC, NOW)
    assert Event(EventType.WARNING, "CheckpointFailed", FAILURE) in first.after
    status = first.status
    assert degraded(status) == ("True", "CheckpointFailed", FAILURE)
    assert status["checkpointFailure"] == {"number": 3, "path": "/ck/step-15", "step": 15,
                                           "reason": REASON, "time": stamp(NOW)}  # fmt: skip
    assert status["lastCheckpoint"]["number"] == 2  # the last good one stays the restore's
    # The next pass finds it in status: no second event, still Degraded.
    again = decide(pods, record, with_status(PERIODIC, **status), NOW + 1)
    assert not any(isinstance(a, Event) for a in again.after)
    assert degraded(again.status)[:2] == ("True", "CheckpointFailed")
    assert again.status["checkpointFailure"]["time"] == stamp(NOW)


def test_a_failed_checkpoint_is_not_asked_again_the_next_period_is() -> None:
    """Checkpoint 3 (step 15) failed: the pass asks for checkpoint 4 at step 20, once."""
    pods = seen(*members(17, last_checkpoint=checkpoint(2, 10, "/ck/step-10"),
                        failed_checkpoint=failed(3, 15, "/ck/step-15", REASON)))  # fmt: skip
    decision = decide(pods, Record(world=W3, checkpoint_asked=3), PERIODIC, NOW)
    assert decision.ask == Checkpoint(("p0", "p1", "p2"), 4, "/ck/step-20", 20, "")
    asked = decide(pods, Record(world=W3, checkpoint_asked=4), PERIODIC, NOW)
    assert asked.ask is None


def test_a_checkpoint_saved_after_a_failed_one_clears_the_failure() -> None:
    earlier = {"number": 3, "path": "/ck/step-15", "step": 15, "reason": REASON,
               "time": stamp(NOW - 60)}  # fmt: skip
    pods = seen(*members(22, last_checkpoint=checkpoint(4, 20, "/ck/step-20")))
    status = decide(pods, Record(world=W3, checkpoint_asked=4),
                    with_status(PERIODIC, checkpointFailure=earlier), NOW).status  # fmt: skip
    assert status["checkpointFailure"] is None  # the merge patch removes it
    assert status["lastCheckpoint"]["number"] == 4
    assert degraded(status)[:2] == ("False", "AsPlanned")


def test_after_a_fall_back_a_checkpoint_of_an_earlier_step_saved_later_clears_the_failure() -> None:
    """Checkpoint 3 of step 15 failed; the job fell back to step 10 and saved step 12 since: the
    failure is over. A checkpoint of step 12 seen before the failure does not end it."""
    earlier = {"number": 3, "path": "/ck/step-15", "step": 15, "reason": REASON,
               "time": stamp(NOW - 60)}  # fmt: skip
    pods = seen(*members(13, last_checkpoint=checkpoint(4, 12, "/ck/step-12")))
    status = decide(pods, Record(world=W3, checkpoint_asked=4),
                    with_status(PERIODIC, lastCheckpoint=SAVED, checkpointFailure=earlier),
                    NOW).status  # fmt: skip
    assert status["checkpointFailure"] is None
    assert status["lastCheckpoint"]["step"] == 12
    assert degraded(status)[:2] == ("False", "AsPlanned")
    before = {"number": 4, "path": "/ck/step-12", "step": 12, "time": stamp(NOW - 120)}
    status = decide(pods, Record(world=W3, checkpoint_asked=4),
                    with_status(PERIODIC, lastCheckpoint=before, checkpointFailure=earlier),
                    NOW).status  # fmt: skip
    assert status["checkpointFailure"] == earlier
    assert degraded(status)[:2] == ("True", "CheckpointFailed")


def test_a_suspension_whose_checkpoint_failed_asks_again_after_a_while() -> None:
    suspending = job(3, checkpoint={"path": "/ck"}, suspend=True)
    saving = Suspension(1, "/ck/suspend-1-1")
    pods = seen(*members(12, failed_checkpoint=failed(1, 12, "/ck/suspend-1-1", REASON)))
    record = Record(world=W3, checkpoint_asked=1, suspended=saving)
    seen_at = {"number": 1, "path": "/ck/suspend-1-1", "step": 12, "reason": REASON,
               "time": stamp(NOW - 10)}  # fmt: skip
    the_job = with_status(suspending, checkpointFailure=seen_at)
    waiting = decide(pods, record, the_job, NOW)
    assert waiting.ask is None and waiting.record == record
    ready = next(c for c in waiting.status["conditions"] if c["type"] == "Ready")
    assert f"asking again in {RETRY_SECONDS - 10:.0f} s" in ready["message"]
    later = decide(pods, record, the_job, NOW + RETRY_SECONDS)
    assert later.record.suspended == Suspension(2, "/ck/suspend-1-2")
    assert later.ask == Checkpoint(("p0", "p1", "p2"), 2, "/ck/suspend-1-2", 12)


def test_a_failed_last_checkpoint_ends_the_job_unexported_saying_why() -> None:
    the_job = job(3, checkpoint={"path": "/ck", "exportTo": "/hf"})
    finished = pb.AgentStatus(phase=pb.AgentStatus.DONE, ready=True, epoch=1, step=100)
    finished.failed_checkpoint.CopyFrom(failed(1, 100, "/ck/step-100", REASON))
    pods = seen(*(pod(m, finished, role=M) for m in ("p0", "p1", "p2")))
    status = decide(pods, Record(world=W3, checkpoint_asked=1), the_job, NOW).status
    assert status["phase"] == "Succeeded" and "exportedTo" not in status
    message = next(c["message"] for c in status["conditions"] if c["type"] == "Succeeded")
    assert message == (
        f"trained 100 steps; not exported to /hf: checkpoint 1 of step 100 to /ck/step-100 "
        f"failed: {REASON}"
    )


def test_after_a_resume_a_checkpoint_of_a_later_step_is_the_last_whatever_its_number() -> None:
    """A suspension took number 4 at step 13, ahead of the periodic ones (numbers follow the
    step: 4 is step 20's). After the resume, step 15's (number 3) and step 20's (number 4
    again) are newer, and so is a failure of step 20's."""
    suspended = {"number": 4, "path": "/ck/suspend-1-4", "step": 13, "time": stamp(NOW - 60)}
    kept = with_status(PERIODIC, lastCheckpoint=suspended)
    resumed = world(PERIODIC, ["p0", "p1", "p2"], 2)
    for number, step in ((3, 15), (4, 20)):
        saved = checkpoint(number, step, f"/ck/step-{step}")
        pods = seen(*members(step + 1, last_checkpoint=saved))
        status = decide(pods, Record(world=resumed, checkpoint_asked=number), kept, NOW).status
        assert status["lastCheckpoint"] == {"number": number, "path": f"/ck/step-{step}",
                                            "step": step, "time": stamp(NOW)}  # fmt: skip
    lost = seen(*members(21, failed_checkpoint=failed(4, 20, "/ck/step-20", REASON)))
    decision = decide(lost, Record(world=resumed, checkpoint_asked=4), kept, NOW)
    assert decision.status["lastCheckpoint"] == suspended
    assert decision.status["checkpointFailure"]["step"] == 20
    assert any(e.reason == "CheckpointFailed" for e in decision.after)


def test_a_second_suspension_never_takes_the_directory_of_the_first() -> None:
    """Suspended in epoch 1 as number 4, resumed in epoch 2: the periodic numbers reach 3
    again, and the next suspension, number 4 again, is saved beside the first."""
    suspending = job(3, checkpoint={"path": "/ck", "everySteps": 5}, suspend=True)
    resumed = world(suspending, ["p0", "p1", "p2"], 2)
    pods = seen(*members(16, last_checkpoint=checkpoint(3, 15, "/ck/step-15")))
    decision = decide(pods, Record(world=resumed, last_epoch=2, checkpoint_asked=3), suspending,
                      NOW)  # fmt: skip
    assert decision.record.suspended == Suspension(4, "/ck/suspend-2-4")
    assert decision.ask == Checkpoint(("p0", "p1", "p2"), 4, "/ck/suspend-2-4", 16)
