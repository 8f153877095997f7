"""The executor, against a fake API server and fake agents that log every call in order: what is
done before the status is written, that it is written once, and that no Prepare is sent before
the reconfiguration it belongs to is recorded. The controller's pass on the same fakes."""

from __future__ import annotations

import base64
import copy
import datetime
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest
from liveshard_operator import controller as controller_module
from liveshard_operator import pki, render
from liveshard_operator.act import Executor, Options
from liveshard_operator.actions import AbortOn, Prepare
from liveshard_operator.agents import FAN_OUT, AgentClient, AgentError, fan_out, prepare_request
from liveshard_operator.controller import JobController
from liveshard_operator.decide import decide
from liveshard_operator.kube import ApiError, Kube, Stale
from liveshard_operator.observation import Observation
from liveshard_operator.publish import merge_patch
from liveshard_operator.world import Record

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.job import Deadlines
from liveshard_core.layout.layout import Layout
from tests.operator.test_decide import CASES, CHECKPOINTED, J3, TRAINING3, W3, condition
from tests.operator.values import BODY, NOW, job, pending, pod, seen, standby, training

NOW_PLUS_A_YEAR = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=365)

Calls = list[tuple[Any, ...]]


class FakeKube:
    """The API server's side of what the controller does, logged."""

    def __init__(self, calls: Calls, job: dict[str, Any] | None = None) -> None:
        self.calls, self.job = calls, job
        self.versions: list[str | None] = []  # the resourceVersion each status write was over
        self.secrets: dict[str, dict[str, Any]] = {}  # the TLS Secrets, once created

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.job

    def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any], version: str | None = None
    ) -> str:
        self.calls.append(("status", status))
        self.versions.append(version)
        return f"written-{len(self.versions)}"

    def remove_job_finalizer(self, job: dict[str, Any], finalizer: str) -> None:
        self.calls.append(("unfinalize", finalizer))

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        if resource == "secrets" and name.endswith("-tls"):
            return self.secrets.get(name)
        return {"data": {"token": base64.b64encode(b"secret").decode()}}

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        if resource == "secrets":  # as the API server stores it: stringData as data
            text = body.get("stringData") or {}
            data = {k: base64.b64encode(v.encode()).decode() for k, v in text.items()}
            self.secrets[body["metadata"]["name"]] = {"data": data}
        else:
            self.calls.append(("create", resource))
        return body

    def delete(self, namespace: str, resource: str, name: str) -> None:
        self.calls.append(("delete", name))

    def patch(self, namespace: str, resource: str, name: str, body: dict[str, Any]) -> None:
        if resource == "secrets":
            self.secrets[name]["data"].update(body["data"])
            annotations = (body.get("metadata") or {}).get("annotations") or {}
            self.secrets[name].setdefault("metadata", {}).setdefault("annotations", {}).update(
                annotations
            )
            self.calls.append(("renew", name))
        else:
            self.calls.append(("label", name))


class FakeAgent:
    """One agent: logs each call, refuses those named in `refuse` (UNAVAILABLE, or the code
    after a colon: `abort:ABORTED`)."""

    def __init__(self, member: str, calls: Calls, refuse: tuple[str, ...] = ()) -> None:
        self.member, self.calls = member, calls
        self.refuse = dict((*r.split(":"), "UNAVAILABLE")[:2] for r in refuse)

    def _call(self, method: str, *args: Any) -> None:
        self.calls.append((method, self.member, *args))
        if method in self.refuse:
            code = grpc.StatusCode[self.refuse[method]]
            raise AgentError(self.member, code, f"{method} refused")

    def host_store(self, epoch: int) -> tuple[str, int]:
        self._call("host_store", epoch)
        return ("10.0.0.0", 7000 + epoch)

    def _command(self, method: str, members: Sequence[str], *args: Any) -> None:
        """A command, logged once per member it is for, with the members the call named (none:
        its own) last."""
        for member in members[1:]:
            self.calls.append((method, member, *args, tuple(members)))
        self._call(method, *args, tuple(members))

    def prepare(self, request: pb.PrepareRequest, members: Sequence[str] = ()) -> None:
        store = (request.store.host, request.store.port)
        self._command("prepare", members, request.epoch, store, request)

    def abort(self, epoch: int, wait: bool = True, members: Sequence[str] = ()) -> None:
        self._command("abort", members, epoch, "waited" if wait else "queued")

    def checkpoint(
        self, number: int, path: str, at_step: int, export_to: str = "", members: Sequence[str] = ()
    ) -> None:
        self._command("checkpoint", members, number)

    def switch(self, epoch: int, at_step: int, members: Sequence[str] = ()) -> None:
        self._command("switch", members, epoch, at_step)

    def release(self, saved: int = 0, discard: bool = False, members: Sequence[str] = ()) -> None:
        self._command("release", members, saved)

    def rotate_certificate(self, cert: bytes, key: bytes, ca: bytes = b"") -> None:
        self._call("rotate", pki.fingerprint(cert), len(pki.certificates(ca)))

    def close(self) -> None:
        pass


def executor(calls: Calls, seen_: Observation, **refuse: tuple[str, ...]) -> Executor:
    clients: dict[str, Any] = {m: FakeAgent(m, calls, refuse.get(m, ())) for m in seen_.pods}
    events = lambda job, kind, reason, message: calls.append(("event", reason))  # noqa: E731
    return Executor(FakeKube(calls), "ns", "tiny", events, clients)  # type: ignore[arg-type]


def kinds(calls: Calls) -> list[str]:
    return [" ".join(str(part) for part in call[:2]) if call[0] != "status" else "status"
            for call in calls]  # fmt: skip


@pytest.mark.parametrize(("per_call", "most"), [(1, FAN_OUT), (8, FAN_OUT // 8), (64, 1)])
def test_the_fan_out_keeps_at_most_fan_out_members_calls_in_flight(
    per_call: int, most: int
) -> None:
    # A call for a pod's 8 members counts 8: the agents' side takes no more at once than with
    # one call a member.
    in_flight, highest = 0, 0
    changed = threading.Condition()

    def call(_: int) -> None:
        nonlocal in_flight, highest
        with changed:
            in_flight += 1
            highest = max(highest, in_flight)
            changed.notify_all()
            changed.wait_for(lambda: highest >= most, timeout=5)
            in_flight -= 1

    fan_out(call, list(range(3 * FAN_OUT)), per_call)
    assert highest == most


def test_the_reconfiguration_is_recorded_before_any_prepare() -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []
    executor(calls, pods).run(decide(pods, Record(), job(4), NOW))
    # The agent calls go out together (in any order), then the event.
    order = kinds(calls)
    assert order[:2] == ["host_store p0", "status"] and order[-1] == "event Reconfiguring"
    assert sorted(order[2:-1]) == ["prepare p0", "prepare p1", "prepare p2", "prepare p3"]
    (status,) = [call[1] for call in calls if call[0] == "status"]
    assert status["reconfiguration"]["inFlight"]["store"] == {"host": "10.0.0.0", "port": 7000}
    assert all(call[3] == ("10.0.0.0", 7000) for call in calls if call[0] == "prepare")
    # One request, made once, goes to every member: the first world's, with no `from`.
    (request,) = {id(call[4]): call[4] for call in calls if call[0] == "prepare"}.values()
    assert list(request.to.members) == ["p0", "p1", "p2", "p3"] and not request.HasField("from")


def test_a_prepare_request_carries_the_whole_reconfiguration() -> None:
    old = Layout(dp=3, tp=1, pp=1, ep=1, zero=0, pp_layers=(4,), members=("a", "b", "c"))
    to = replace(old, dp=2, members=("a", "d"))
    prepare = Prepare(
        "d", 7, ("10.0.0.1", 29500), to, old, lost=("b",), budget=1 << 20,
        deadlines=Deadlines(op=5.0, switch=6.0, prepare=7.0), restore_from="",
        pods=(("a", "pod-0"), ("d", "pod-1")),
    )  # fmt: skip
    request = prepare_request(prepare)
    assert (request.epoch, request.store.host, request.store.port) == (7, "10.0.0.1", 29500)
    assert list(request.to.members) == ["a", "d"] and request.to.dp == 2
    assert list(getattr(request, "from").members) == ["a", "b", "c"]
    assert list(request.lost) == ["b"] and request.budget_bytes == 1 << 20
    d = request.deadlines
    assert (d.op_seconds, d.switch_seconds, d.prepare_seconds) == (5.0, 6.0, 7.0)
    assert dict(request.pods) == {"a": "pod-0", "d": "pod-1"} and request.at_step == 0


def test_a_store_no_member_can_host_begins_nothing() -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []
    executor(calls, pods, p0=("host_store",)).run(decide(pods, Record(), job(4), NOW))
    assert kinds(calls) == ["host_store p0", "status"]
    status = calls[1][1]
    assert status["reconfiguration"]["inFlight"] is None and status["phase"] == "Pending"


def test_aborts_go_out_before_the_abort_is_recorded() -> None:
    case = CASES["in flight: a member failed to prepare"]
    calls: Calls = []
    executor(calls, case.seen, p1=("abort",)).run(decide(case.seen, case.record, case.job, NOW))
    # The aborts go out together; a refused one is logged; then the one write, then the event.
    order = kinds(calls)
    assert sorted(order[:3]) == ["abort p0", "abort p1", "abort p2"]
    assert order[3:] == ["status", "event ReconfigurationAborted"]
    assert calls[3][1]["reconfiguration"]["attempts"] == 2


def test_an_abort_overtaken_by_the_commit_is_not_recorded() -> None:
    case = CASES["in flight: a member failed to prepare"]
    calls: Calls = []
    decision = decide(case.seen, case.record, case.job, NOW)
    executor(calls, case.seen, p1=("abort:ABORTED",)).run(decision)
    # p1 answers that the epoch is in effect there: the record keeps it in flight, unaborted,
    # and no event says it aborted; the next pass sees the commit.
    order = kinds(calls)
    assert sorted(order[:3]) == ["abort p0", "abort p1", "abort p2"] and order[3:] == ["status"]
    written = calls[3][1]
    assert written["reconfiguration"]["attempts"] == 1
    assert written["reconfiguration"]["inFlight"]["epoch"] == 2
    assert "the abort came after the commit on p1" in condition(written, "Ready")["message"]


def test_an_abort_of_an_epoch_given_up_before_does_not_undo_the_abort_in_flight() -> None:
    case = CASES["in flight: a member failed to prepare"]
    # p3 trains with epoch 0 pending, given up long ago: it answers its abort ABORTED.
    stray = pod("p3", training(1, pending=pending(0)))
    pods = Observation({**case.seen.pods, "p3": stray})
    calls: Calls = []
    executor(calls, pods, p3=("abort:ABORTED",)).run(decide(pods, case.record, case.job, NOW))
    order = kinds(calls)
    assert sorted(order[:4]) == ["abort p0", "abort p1", "abort p2", "abort p3"]
    assert order[4:] == ["status", "event ReconfigurationAborted"]
    assert calls[4][1]["reconfiguration"]["inFlight"] is None


def test_a_change_of_many_members_waits_for_fan_out_drops_and_queues_the_others() -> None:
    case = CASES["in flight: a member failed to prepare"]
    decision = decide(case.seen, case.record, case.job, NOW)
    # As if the change had FAN_OUT + 5 members pending: 4 of them in one pod ("big"); and a
    # stray, pending an epoch given up before.
    big = [replace(pod("big", training(1, pending=pending(2))), name=f"q{i}", pod="big")
           for i in range(4)]  # fmt: skip
    pods = Observation({**case.seen.pods, **{p.name: p for p in big}})
    flying = [AbortOn(f"m{i}", 2) for i in range(FAN_OUT)]
    flying += [AbortOn(p.name, 2) for p in big] + [AbortOn("m99", 2)]
    decision = replace(decision, seen=pods, before=(AbortOn("stray", 1), *flying))
    calls: Calls = []
    run = executor(calls, pods)
    run.clients.update({a.member: FakeAgent(a.member, calls) for a in decision.before})
    run.clients["m99"] = FakeAgent("m99", calls, ("abort:ABORTED",))  # in effect there now
    run.run(decision)
    sent = [call for call in calls if call[0] == "abort"]
    # FAN_OUT members waited for, a call each; the others queued, the pod's 4 in one call.
    assert {call[1]: call[3] for call in sent} == {"stray": "queued"} | {
        a.member: "waited" if i < FAN_OUT else "queued" for i, a in enumerate(flying)
    }
    assert [call[4] for call in sent if call[1] == "q0"] == [("q0", "q1", "q2", "q3")]
    # A queued abort answered ABORTED still tells the commit came first.
    written = next(call[1] for call in calls if call[0] == "status")
    assert written["reconfiguration"]["inFlight"]["epoch"] == 2
    assert "the abort came after the commit on m99" in condition(written, "Ready")["message"]


def test_a_finished_job_lets_its_pods_go_before_it_is_marked_succeeded() -> None:
    case = CASES["the job trained its last step: release and delete every pod"]
    calls: Calls = []
    executor(calls, case.seen).run(decide(case.seen, case.record, case.job, NOW))
    assert kinds(calls) == [
        "release p0", "delete p0", "release p1", "delete p1", "release p2", "delete p2", "status",
    ]  # fmt: skip
    assert calls[-1][1]["phase"] == "Succeeded"


def test_a_silent_member_is_recorded_before_its_pod_is_deleted() -> None:
    case = CASES["silent for twice the op deadline: its pod is deleted and it counts as lost"]
    calls: Calls = []
    executor(calls, case.seen).run(decide(case.seen, case.record, case.job, NOW))
    order = kinds(calls)
    assert order.index("status") < order.index("delete p2")
    assert order.count("status") == 1


@pytest.mark.parametrize(("refuse", "asked"), [((), 3), (("checkpoint",), 0)])
def test_a_checkpoint_is_recorded_once_every_member_took_it(
    refuse: tuple[str, ...], asked: int
) -> None:
    pods = seen(*TRAINING3)
    calls: Calls = []
    executor(calls, pods, p1=refuse).run(decide(pods, Record(world=W3), CHECKPOINTED, NOW))
    # Every member is asked at once; one refusal and nothing is recorded: the next pass asks
    # every member again.
    order = kinds(calls)
    assert sorted(order[:-1]) == ["checkpoint p0", "checkpoint p1", "checkpoint p2"]
    assert order[-1] == "status"
    assert calls[-1][1]["reconfiguration"]["checkpointAsked"] == asked


def test_the_controller_reports_an_invalid_spec_and_leaves_a_terminal_job_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: Calls = []
    bad = {**BODY, "spec": {**BODY["spec"], "parallelism": {"tp": 3}}}
    controller = JobController(FakeKube(calls, bad), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    assert controller.reconcile()
    ((kind, status),) = calls
    assert kind == "status" and status["phase"] == "Pending"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "tp=3 must divide heads=4" in ready["message"]

    calls.clear()
    done = {**BODY, "status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}
    monkeypatch.setattr(controller_module, "observe", lambda *_: pytest.fail("observed"))
    assert JobController(FakeKube(calls, done), "ns", "tiny", lambda *_: None).reconcile()  # type: ignore[arg-type]
    assert calls == []
    assert not JobController(FakeKube(calls, None), "ns", "tiny", lambda *_: None).reconcile()  # type: ignore[arg-type]


def test_the_controller_observes_decides_and_acts(monkeypatch: pytest.MonkeyPatch) -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []
    monkeypatch.setattr(controller_module, "observe", lambda *_: pods)
    controller = JobController(FakeKube(calls, BODY), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    clients: dict[str, AgentClient] = controller.clients
    clients.update({m: FakeAgent(m, calls) for m in pods.pods})  # type: ignore[misc]
    assert controller.reconcile()
    assert kinds(calls)[:2] == ["host_store p0", "status"]


@pytest.mark.parametrize(
    ("refuse", "waits"),
    [((), 30.0), (("prepare",), controller_module.RESEND), (("prepare:INVALID_ARGUMENT",), 30.0)],
)
def test_a_prepare_the_agent_may_take_later_is_sent_again_soon(
    monkeypatch: pytest.MonkeyPatch, refuse: tuple[str, ...], waits: float
) -> None:
    # Unavailable or past its deadline, the Prepare goes again after RESEND, not the period
    # (the change waits on every member's); a refusal waits for news or the period.
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []
    monkeypatch.setattr(controller_module, "observe", lambda *_: pods)
    controller = JobController(FakeKube(calls, BODY), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    controller.clients.update(
        {m: FakeAgent(m, calls, refuse if m == "p2" else ()) for m in pods.pods}  # type: ignore[misc]
    )
    assert controller.reconcile()
    assert sorted(c[1] for c in calls if c[0] == "prepare") == ["p0", "p1", "p2", "p3"]
    waited: list[float] = []
    monkeypatch.setattr(controller_module.sentinel, "wait", lambda _w, s, _f: waited.append(s))
    controller.wait(threading.Event(), 30.0)
    assert waited == [waits]


def test_the_resend_wait_doubles_while_an_agent_keeps_failing_and_ends_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An agent too loaded to answer in time is not sent its Prepare more often for it: each
    # pass in a row that leaves it unsent doubles the wait, up to the period; a pass that sends
    # everything ends the backoff.
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []
    monkeypatch.setattr(controller_module, "observe", lambda *_: pods)
    controller = JobController(FakeKube(calls, BODY), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    late = FakeAgent("p2", calls, ("prepare",))
    controller.clients.update({m: late if m == "p2" else FakeAgent(m, calls) for m in pods.pods})  # type: ignore[misc]
    waited: list[float] = []
    monkeypatch.setattr(controller_module.sentinel, "wait", lambda _w, s, _f: waited.append(s))
    for _ in range(4):
        assert controller.reconcile()
        controller.wait(threading.Event(), 3.0)
    resend = controller_module.RESEND
    assert waited == [resend, 2 * resend, 4 * resend, 3.0]
    assert [c[1] for c in calls if c[0] == "prepare"].count("p2") == 4
    controller.clients["p2"] = FakeAgent("p2", calls)  # type: ignore[assignment]
    assert controller.reconcile()
    controller.wait(threading.Event(), 3.0)
    assert waited[-1] == 3.0 and controller.unsent_passes == 0


class SlowKube(FakeKube):
    """An API server that takes 0.1 s to return the job."""

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        time.sleep(0.1)
        return super().get_job(namespace, name)


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_long_pass_with_nothing_in_flight_is_followed_by_a_longer_wait(
    monkeypatch: pytest.MonkeyPatch, in_flight: bool
) -> None:
    # With nothing in flight, the wait is IDLE_STRETCH times the pass at least (a watch event
    # still ends it); a reconfiguration in flight keeps the wait asked.
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []
    monkeypatch.setattr(controller_module, "observe", lambda *_: pods)
    body = BODY if in_flight else {**BODY, "spec": {**BODY["spec"], "parallelism": {"tp": 3}}}
    controller = JobController(SlowKube(calls, body), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    controller.clients.update({m: FakeAgent(m, calls) for m in pods.pods})  # type: ignore[misc]
    assert controller.reconcile()
    assert any(c[0] == "prepare" for c in calls) == in_flight
    waited: list[float] = []
    monkeypatch.setattr(controller_module.sentinel, "wait", lambda _w, s, _f: waited.append(s))
    controller.wait(threading.Event(), 0.2)
    if in_flight:
        assert waited == [0.2]
    else:
        assert waited[0] >= controller_module.IDLE_STRETCH * 0.1 > 0.2


class Changed(FakeKube):
    """The job changed since the pass read it: the status write is refused (409)."""

    def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any], version: str | None = None
    ) -> str:
        super().patch_job_status(namespace, name, status, version)
        raise Stale("PATCH", "/apis/liveshard.io/.../status", 409, '{"reason":"Conflict"}')


def test_the_status_is_written_over_the_version_read_and_a_changed_job_ends_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    monkeypatch.setattr(controller_module, "observe", lambda *_: pods)
    body = {**BODY, "metadata": {**BODY["metadata"], "resourceVersion": "41"}}
    for kube, after in ((FakeKube([], body), True), (Changed([], body), False)):
        controller = JobController(kube, "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
        controller.clients.update({m: FakeAgent(m, kube.calls) for m in pods.pods})  # type: ignore[misc]
        assert controller.reconcile()  # a refused write is no failure: the next pass reads again
        assert kube.versions == ["41"]
        # Refused, the pass stops at the write: no Prepare goes out for an unrecorded epoch.
        assert kinds(kube.calls)[:2] == ["host_store p0", "status"]
        assert any(call[0] == "prepare" for call in kube.calls) is after
        # Written with the reconfiguration in flight: the write's watch event wakes nothing.
        assert controller.executor.quiet == ("written-1" if after else None)


def test_a_steady_pass_that_only_moved_the_step_writes_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its watch event wakes nothing (`JobLoop.own_write`): the next pass comes at the period.
    body = {**J3.body, "status": {"reconfiguration": Record(world=W3).to_dict()}}
    kube = FakeKube([], body)
    controller = JobController(kube, "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    for step, quiet in ((10, None), (14, "written-2"), (15, "written-3")):
        pods = seen(*(pod(m, training(1, step=step), role="member") for m in W3.members))
        monkeypatch.setattr(controller_module, "observe", lambda *_, p=pods: p)
        assert controller.reconcile()
        (written,) = [c[1] for c in kube.calls if c[0] == "status"][-1:]
        assert written["step"] == step and controller.executor.quiet == quiet
        kube.job = {**body, "status": merge_patch(kube.job["status"], written)}


def test_the_status_patch_names_the_version_read_and_a_409_on_it_is_stale() -> None:
    sent: Calls = []

    class Server(Kube):
        conflict = True

        def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
            sent.append((method, path, body))
            if self.conflict:
                raise ApiError(method, path, 409, '{"reason":"Conflict"}')
            return {**body, "metadata": {"resourceVersion": "42"}}

    server = Server("https://api")
    with pytest.raises(Stale):
        server.patch_job_status("ns", "tiny", {"phase": "Running"}, "41")
    path = "/apis/liveshard.io/v1alpha1/namespaces/ns/elastictrainingjobs/tiny/status"
    body = {"status": {"phase": "Running"}, "metadata": {"resourceVersion": "41"}}
    assert sent == [("PATCH", path, body)]
    server.conflict = False  # written: the job's version after the write is returned
    assert server.patch_job_status("ns", "tiny", {"phase": "Running"}, "41") == "42"


def test_a_finalizer_left_by_an_earlier_operator_is_taken_off() -> None:
    calls: Calls = []
    meta = {**BODY["metadata"], "finalizers": [controller_module.LEGACY_FINALIZER, "other"]}
    controller = JobController(FakeKube(calls, {**BODY, "metadata": meta}), "ns", "tiny",
                               lambda *_: None)  # type: ignore[arg-type]  # fmt: skip
    assert controller.reconcile()
    assert calls == [("unfinalize", "liveshard.io/finalizer")]


class NoPodGroups(FakeKube):
    """An API server without either PodGroup kind, and none of the job's objects yet."""

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        if resource.startswith("podgroups"):
            return None
        return super().get(namespace, resource, name)

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        if resource.startswith("podgroups"):
            self.calls.append(("create", resource, body))
            raise ApiError("POST", "/apis/scheduling.x-k8s.io/...", 404, "404 page not found")
        return super().create(namespace, resource, body)


class NoPolicies(FakeKube):
    """An API server with none of the job's NetworkPolicies yet."""

    def __init__(self) -> None:
        super().__init__([])
        self.created: list[tuple[str, dict[str, Any]]] = []
        self.policy: dict[str, Any] | None = None
        self.refuse_patch = False  # as under an older chart's grants

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        if resource == "networkpolicies":
            return self.policy
        return super().get(namespace, resource, name)

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        self.created.append((resource, body))
        if resource == "networkpolicies":
            self.policy = copy.deepcopy(body)
        return super().create(namespace, resource, body)

    def patch(self, namespace: str, resource: str, name: str, body: dict[str, Any]) -> None:
        if resource == "networkpolicies":
            assert self.policy is not None
            self.calls.append(("patch", resource))
            if self.refuse_patch:
                raise ApiError("PATCH", f"networkpolicies/{name}", 403, "forbidden")
            self.policy["spec"].update(copy.deepcopy(body["spec"]))
            return
        super().patch(namespace, resource, name, body)


def test_a_job_gets_its_network_policy_once_when_the_operators_pods_are_named() -> None:
    the_job = job(3)
    operator = render.Isolation("ops", {"app": "op"})
    for options, made in ((Options(), 0), (Options(isolation=operator), 1)):
        kube = NoPolicies()
        executor = Executor(kube, "ns", "tiny", lambda *_: None, {}, options)  # type: ignore[arg-type]
        for _ in range(2):
            executor.ensure_objects(the_job.body, the_job.spec)
        policies = [b for r, b in kube.created if r == "networkpolicies"]
        assert len(policies) == made
        if made:
            assert policies == [render.network_policy(the_job.body, the_job.spec, operator)]
            assert ("patch", "networkpolicies") not in kube.calls  # up to date: left alone
    # The operator upgraded with other scrapers: the job's rules follow, once.
    scrapers = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    wider = Options(isolation=render.Isolation("ops", {"app": "op"}, scrapers))
    executor = Executor(kube, "ns", "tiny", lambda *_: None, {}, wider)  # type: ignore[arg-type]
    for _ in range(2):
        executor.ensure_objects(the_job.body, the_job.spec)
    assert kube.calls.count(("patch", "networkpolicies")) == 1
    assert kube.policy == render.network_policy(the_job.body, the_job.spec, wider.isolation)
    # Without the grant to patch it, the pass goes on (the policy stays as it is).
    kube.refuse_patch = True
    narrower = Executor(kube, "ns", "tiny", lambda *_: None, {}, Options(isolation=operator))  # type: ignore[arg-type]
    narrower.ensure_objects(the_job.body, the_job.spec)
    assert kube.calls.count(("patch", "networkpolicies")) == 2


def test_a_gang_job_gets_its_pod_group_or_a_condition_naming_the_missing_kind() -> None:
    calls: Calls = []
    gang = job(3, minReplicas=2, scheduling={"gang": True, "pendingTimeoutSeconds": 90})
    assert render.worker_pod(gang.body, gang.spec)["metadata"]["labels"][
        render.POD_GROUP_LABEL
    ] == "tiny"  # fmt: skip
    assert render.POD_GROUP_LABEL not in render.worker_pod(BODY, job().spec)["metadata"]["labels"]
    controller = JobController(NoPodGroups(calls, gang.body), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    assert controller.reconcile()
    (created, status) = calls
    assert created[:2] == ("create", "podgroups")
    assert created[2]["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 90}
    assert created[2]["metadata"]["ownerReferences"][0]["name"] == "tiny"
    ready = next(c for c in status[1]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "serves no PodGroup" in ready["message"]


def test_a_gang_job_of_volcano_workers_gets_volcanos_pod_group() -> None:
    calls: Calls = []
    template = {
        "metadata": {"annotations": {render.VOLCANO_QUEUE_ANNOTATION: "research", "a": "b"}},
        "spec": {"schedulerName": "volcano", "containers": [{"name": "agent"}]},
    }
    gang = job(3, minReplicas=2, template=template, scheduling={"gang": True})
    meta = render.worker_pod(gang.body, gang.spec)["metadata"]
    assert meta["annotations"] == {
        render.VOLCANO_QUEUE_ANNOTATION: "research", "a": "b",
        render.VOLCANO_GROUP_ANNOTATION: "tiny",
    }  # fmt: skip
    assert render.POD_GROUP_LABEL not in meta["labels"]
    controller = JobController(NoPodGroups(calls, gang.body), "ns", "tiny", lambda *_: None)  # type: ignore[arg-type]
    assert controller.reconcile()
    (created, status) = calls
    assert created[:2] == ("create", "podgroups.scheduling.volcano.sh")
    assert created[2]["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert created[2]["spec"] == {"minMember": 2, "queue": "research"}
    ready = next(c for c in status[1]["conditions"] if c["type"] == "Ready")
    assert "scheduling.volcano.sh/v1beta1" in ready["message"] and "Volcano" in ready["message"]
