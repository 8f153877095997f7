"""Worker pods that fail before they become members: the backoff before each new pod, what the
job's Events and conditions say, Failed without a world, and the record that keeps the count (the
decisions themselves are rows of `test_decide.CASES`). No cluster, no agent."""

from __future__ import annotations

from typing import Any

import pytest
from liveshard_operator import render
from liveshard_operator.actions import DeletePod, Event, EventType, ReleaseMember
from liveshard_operator.decide import decide
from liveshard_operator.start_failures import backoff
from liveshard_operator.world import Record, StartFailures

from liveshard_core.errors import InvalidInput
from tests.operator.values import NOW, failed, job, pod, seen, standby, training, world

TWO_TO_START = job(2, minReplicas=2)
# What the kubelet says of an agent that refused a missing data path (its last log lines).
REFUSED = ("container agent: Error, exit code 2: liveshard-agent: LIVESHARD_CONFIG: training: "
           "/data/x: no such file or folder")  # fmt: skip
OLD = NOW - 1000


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


@pytest.mark.parametrize(
    ("count", "seconds"), [(1, 10), (2, 20), (3, 40), (4, 80), (5, 160), (6, 300), (9, 300)]
)
def test_the_backoff_doubles_from_10_s_to_5_minutes(count: int, seconds: float) -> None:
    assert backoff(count) == seconds


def test_each_failure_waits_longer_for_its_replacement() -> None:
    """Pass after pass, a pod that fails at once: each new pod comes a backoff later."""
    record, now, created = Record(), NOW, []
    for name in ("p1", "p2", "p3", "p4"):
        pods = seen(pod("p0", standby(), since=OLD), pod(name, None, gone=True, failure=REFUSED))
        first = decide(pods, record, TWO_TO_START, now)  # counted: no pod yet
        assert not any(a for a in first.after if not isinstance(a, Event))
        record = first.record
        now = record.start_failures.retry_after
        replaced = decide(pods, record, TWO_TO_START, now)
        assert [type(a).__name__ for a in replaced.after] == ["DeletePod", "CreatePod"]
        created.append(now)
    assert [b - a for a, b in zip([NOW, *created], created, strict=False)] == [10, 20, 40, 80]


def test_a_failed_start_is_an_event_and_the_degraded_condition_naming_why() -> None:
    pods = seen(pod("p0", standby(), since=OLD), pod("p1", None, gone=True, failure=REFUSED))
    decision = decide(pods, Record(), TWO_TO_START, NOW)
    assert decision.after == (Event(
        EventType.WARNING, "WorkerCrashing",
        f"p1 failed before it became a member (1 in a row): {REFUSED}; a new pod in 10 s",
    ),)  # fmt: skip
    degraded = condition(decision.status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "WorkerCrashing")
    assert degraded["message"] == (
        f"1 worker pod(s) failed to start in a row, the last p1: {REFUSED}; a new pod in 10 s"
    )
    assert decision.status["reconfiguration"]["startFailures"] == {
        "count": 1, "last": f"p1: {REFUSED}", "at": NOW, "retryAfter": NOW + 10, "pods": ["p1"],
    }  # fmt: skip


def test_too_many_in_a_row_without_a_world_fail_the_job() -> None:
    the_job = job(2, minReplicas=2, scheduling={"maxStartFailures": 2})
    pods = seen(pod("p0", standby(), since=OLD), pod("p1", None, gone=True, failure=REFUSED))
    row = StartFailures(1, "p9: OOMKilled", NOW - 30, NOW - 20)
    decision = decide(pods, Record(start_failures=row), the_job, NOW)
    status = decision.status
    failure = condition(status, "Failed")
    assert (status["phase"], failure["status"], failure["reason"]) == (
        "Failed", "True", "WorkersCrashing",
    )  # fmt: skip
    assert failure["message"] == (
        "2 worker pods failed before any became a member (spec.scheduling.maxStartFailures=2); "
        f"the last, p1: {REFUSED}"
    )
    # The standing-by pod is released; the failed one stays for its logs; nothing is created.
    assert decision.before == (ReleaseMember("p0"), DeletePod("p0"))
    assert decision.ask is None
    assert [a.reason for a in decision.after if isinstance(a, Event)] == [
        "WorkerCrashing", "WorkersCrashing",
    ]  # fmt: skip


def test_too_many_in_a_row_with_a_world_train_on_degraded() -> None:
    the_job = job(3, scheduling={"maxStartFailures": 2})
    w2 = world(the_job, ["p0", "p1"], 1)
    pods = seen(pod("p0", training(1), role=render.MEMBER, since=OLD),
                pod("p1", training(1), role=render.MEMBER, since=OLD),
                pod("p2", None, gone=True, failure=REFUSED))  # fmt: skip
    row = StartFailures(1, "p9: OOMKilled", NOW - 30, NOW - 20)
    decision = decide(pods, Record(world=w2, start_failures=row), the_job, NOW)
    status = decision.status
    assert status["phase"] == "Running"
    assert all(c["type"] != "Failed" for c in status["conditions"])
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "WorkerCrashing"
    assert "training on with the 2 members it has; a new pod in 20 s" in degraded["message"]


def test_an_agent_that_reports_failed_is_released_then_deleted_when_replaced() -> None:
    why = "LIVESHARD_CONFIG: training: /data/x: no such file or folder"
    pods = seen(pod("p0", standby(), since=OLD), pod("p1", failed(why)))
    row = StartFailures(1, f"p1: agent: {why}", NOW - 10, NOW, ("p1",))
    decision = decide(pods, Record(start_failures=row), TWO_TO_START, NOW)
    assert decision.after[:2] == (
        ReleaseMember("p1"), DeletePod("p1", f"failed before it became a member: agent: {why}"),
    )  # fmt: skip


def test_a_ready_pod_scheduled_before_the_last_failure_does_not_end_the_row() -> None:
    pods = seen(pod("p0", standby(), since=NOW - 60), pod("p1", None, gone=True, failure=REFUSED))
    row = StartFailures(2, "p9: OOMKilled", NOW - 30, NOW + 10)
    decision = decide(pods, Record(start_failures=row), TWO_TO_START, NOW)
    assert decision.record.start_failures.count == 3


def test_only_a_new_failure_fails_the_job() -> None:
    """A row past the limit left by a job that has since lost its world (suspended) fails
    nothing until another pod fails."""
    row = StartFailures(7, "p9: OOMKilled", NOW - 30, NOW - 20)
    decision = decide(seen(pod("p0", standby(), since=OLD)), Record(start_failures=row),
                      TWO_TO_START, NOW)  # fmt: skip
    assert decision.status["phase"] == "Pending" and decision.record.start_failures == row


def test_the_row_is_kept_in_the_record_and_an_old_record_has_none() -> None:
    row = StartFailures(2, "p1: OOMKilled", NOW, NOW + 20, ("p1",))
    record = Record(start_failures=row)
    assert Record.from_dict(record.to_dict()) == record
    assert Record.from_dict({"lastEpoch": 3}).start_failures == StartFailures()
    assert Record().to_dict()["startFailures"] is None  # a merge patch: removed once over


def test_max_start_failures_defaults_to_5_and_must_be_positive() -> None:
    assert job(2).spec.max_start_failures == 5
    with pytest.raises(InvalidInput, match=r"spec\.scheduling\.maxStartFailures=0 must be"):
        job(2, scheduling={"maxStartFailures": 0})


def test_the_agent_keeps_its_last_log_lines_as_its_termination_message() -> None:
    the_job = job(2)
    agent = render.worker_pod(the_job.body, the_job.spec)["spec"]["containers"][0]
    assert agent["terminationMessagePolicy"] == "FallbackToLogsOnError"
