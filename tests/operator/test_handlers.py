"""The handlers' job loops (one thread each, no kopf daemon): a standby keeps its loops idle (its
controllers to check the job's objects afresh) and runs them once it leads; a deleted job's loop
stops and discards the job's agents, one the operator's shutdown stops does not; a loop's own
write of a job with a reconfiguration in flight does not wake it. The controller is a stand-in
that counts its passes.

The discard itself (a real agent process dropping its state and exiting, whatever it is doing) is
tested in `tests/agent/server/test_flow.py`, and a deleted job's pods ending at once on the local
cluster in `tests/e2e/test_operator.py`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from liveshard_operator import handlers
from liveshard_operator.kube import Throttled

from liveshard_e2e.waiting import wait_until


class Passes:
    """A controller that counts its passes; each writes the job's version `written`, quietly
    (`executor.quiet`) when `quiet`."""

    count = rechecks = 0
    closed = threading.Event()
    discarded: ClassVar[list[str]] = []
    written, quiet = "7", False

    def __init__(self, _: Any, namespace: str, name: str, *__: Any) -> None:
        self.name = name
        self.executor = SimpleNamespace(quiet=None, recheck=self.recheck)

    def recheck(self) -> None:
        Passes.rechecks += 1

    def reconcile(self) -> bool:
        Passes.count += 1
        self.executor.quiet = Passes.written if Passes.quiet else None
        return True

    def wait(self, wake: threading.Event, seconds: float) -> None:
        wake.wait(seconds)

    def discard(self) -> None:
        Passes.discarded.append(self.name)

    def close(self) -> None:
        Passes.closed.set()


class Lease:
    def __init__(self) -> None:
        self.held = False

    def leading(self) -> bool:
        return self.held

    def stop(self) -> None:
        self.held = False


def test_a_standby_runs_no_pass_until_it_leads_and_a_deleted_job_stops_its_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lease = Lease()
    monkeypatch.setattr(handlers, "JobController", Passes)
    monkeypatch.setattr(handlers, "api", lambda: None)
    monkeypatch.setattr(handlers, "ELECTOR", lease)
    handlers.job_changed(type=None, name="tiny", namespace="ns", uid="u-1", body={})
    loop = handlers.loop_of("ns", "tiny")
    assert loop is not None
    handlers.job_changed(type="MODIFIED", name="tiny", namespace="ns", uid="u-1", body={})
    assert handlers.loop_of("ns", "tiny") is loop  # one loop per job
    threading.Event().wait(0.3)
    assert Passes.count == 0  # a standby watches, but runs no pass
    assert Passes.rechecks > 0  # and its first pass as leader checks the job's objects afresh
    lease.held = True
    handlers.wake_all()
    for _ in range(50):
        if Passes.count:
            break
        threading.Event().wait(0.1)
    assert Passes.count > 0, "no pass once leading"
    handlers.job_changed(type="DELETED", name="tiny", namespace="ns", uid="u-1", body={})
    loop.thread.join(5)
    assert not loop.thread.is_alive() and Passes.closed.is_set()
    assert handlers.loop_of("ns", "tiny") is None
    assert Passes.discarded == ["tiny"]
    # The operator stopping ends a loop without discarding anything: another takes the job on.
    handlers.job_changed(type=None, name="other", namespace="ns", uid="u-2", body={})
    other = handlers.loop_of("ns", "other")
    assert other is not None
    handlers.stop_all()
    other.thread.join(5)
    assert not other.thread.is_alive() and Passes.discarded == ["tiny"]


def test_a_quiet_write_wakes_nothing_and_every_other_change_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handlers, "JobController", Passes)
    monkeypatch.setattr(handlers, "api", lambda: None)
    monkeypatch.setattr(handlers, "PERIOD", 60.0)  # a pass only when woken
    monkeypatch.setattr(Passes, "quiet", True)

    def event(version: str) -> int:
        """The passes after the job's watch event of `version`."""
        before = Passes.count
        meta = {"resourceVersion": version}
        handlers.job_changed(type="MODIFIED", name="q", namespace="ns", uid="u-3",
                             body={"metadata": meta})  # fmt: skip
        threading.Event().wait(0.3)
        return Passes.count - before

    try:
        assert event("1") >= 1  # the first event starts the loop
        assert event(Passes.written) == 0  # the loop's own write: the wait follows a member
        assert event("8") == 1  # anyone else's
        monkeypatch.setattr(Passes, "quiet", False)
        assert event("9") == 1
        assert event(Passes.written) == 1  # nothing in flight: a write wakes the next pass
    finally:
        handlers.job_changed(type="DELETED", name="q", namespace="ns", uid="u-3", body={})


def run_until(name: str, done: Callable[[], bool], what: str) -> None:
    """Run job `name`'s loop until `done()` (TimeoutError naming `what` after 4 s), then
    delete the job."""
    handlers.job_changed(type=None, name=name, namespace="ns", uid=f"u-{name}", body={})
    try:
        wait_until(done, 4, what, interval=0.02)
    finally:
        handlers.job_changed(type="DELETED", name=name, namespace="ns", uid=f"u-{name}", body={})


class ThrottledOnce(Passes):
    """A controller whose first pass is throttled (Retry-After: 1 s); it notes each wait asked."""

    waits: ClassVar[list[float]] = []

    def reconcile(self) -> bool:
        Passes.count += 1
        if Passes.count == 1:
            raise Throttled("GET", "/api/v1/namespaces/ns/pods", "{}", "1")
        return True

    def wait(self, wake: threading.Event, seconds: float) -> None:
        ThrottledOnce.waits.append(seconds)
        wake.wait(0.02)


def test_a_throttled_pass_is_retried_after_the_wait_asked_with_a_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(handlers, "JobController", ThrottledOnce)
    monkeypatch.setattr(handlers, "api", lambda: None)
    monkeypatch.setattr(handlers, "PERIOD", 0.25)
    monkeypatch.setattr(Passes, "count", 0)
    run_until("t", lambda: len(ThrottledOnce.waits) >= 2, "two waits")
    assert ThrottledOnce.waits[:2] == [1.0, 0.25]  # the wait asked, then the period again
    (line,) = [r for r in caplog.records if "throttled" in r.getMessage()]
    assert line.levelname == "WARNING" and line.exc_info is None
    assert "GET /api/v1/namespaces/ns/pods" in line.getMessage()


class ThrottledThenWoken(Passes):
    """A controller whose first pass is throttled (Retry-After: 1 s) and whose wait returns at
    once, as a watch event would end it; it notes when each pass began."""

    began: ClassVar[list[float]] = []

    def reconcile(self) -> bool:
        ThrottledThenWoken.began.append(time.monotonic())
        if len(ThrottledThenWoken.began) == 1:
            raise Throttled("PATCH", "/apis/liveshard.dev/v1/x", "{}", "1")
        return True

    def wait(self, wake: threading.Event, seconds: float) -> None:
        pass


def test_a_wake_during_a_throttled_wait_does_not_start_a_pass_before_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handlers, "JobController", ThrottledThenWoken)
    monkeypatch.setattr(handlers, "api", lambda: None)
    run_until("w", lambda: len(ThrottledThenWoken.began) >= 2, "two passes")
    first, second = ThrottledThenWoken.began[:2]
    assert second - first >= 1.0  # the server's Retry-After, though the wait ended at once


def test_the_leader_gauge_follows_the_elector() -> None:
    def leads() -> float | None:
        return handlers.METRICS.registry.get_sample_value("liveshard_operator_leader")

    assert leads() == 1  # without leader election this replica leads
    try:
        handlers.wake_all(False)  # the Elector's callback: the Lease lost
        assert leads() == 0
        handlers.wake_all(True)  # taken
        assert leads() == 1
    finally:
        handlers.METRICS.leader.set(1)
