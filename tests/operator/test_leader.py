"""Leader election on a Lease, against an in-memory API server that keeps one Lease with its
resourceVersion (409 on a stale write, as the real one) and a fake clock: one leader at a time,
the standby takes over only once the Lease expired by its own clock, the leader steps down before
that when it cannot renew, and a released Lease is taken at once; no failed attempt ends the
campaign (one against the real client and a closed port)."""

from __future__ import annotations

import copy
import json
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from liveshard_operator import main
from liveshard_operator.kube import ApiError, JsonApi
from liveshard_operator.leader import Election, Elector

from liveshard_e2e.waiting import wait_until

PATH = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/op"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.now)


class FakeApi:
    """One namespace's Leases, by path; `down` makes every request fail as a lost connection,
    `meddle` runs between this replica's read and its write (another replica's write)."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False
        self.meddle: Any = None

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        if self.down:
            raise OSError("connection refused")
        if method == "GET":
            if path not in self.leases:
                raise ApiError(method, path, 404, json.dumps({"reason": "NotFound"}))
            lease = copy.deepcopy(self.leases[path])
            if self.meddle is not None:
                meddle, self.meddle = self.meddle, None
                meddle()
            return lease
        if method == "POST":
            path = f"{path}/{body['metadata']['name']}"
            if path in self.leases:
                raise ApiError(method, path, 409, json.dumps({"reason": "AlreadyExists"}))
        elif method == "PUT" and body["metadata"]["resourceVersion"] != self.version_of(path):
            raise ApiError(method, path, 409, json.dumps({"reason": "Conflict"}))
        self.version += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.leases[path] = stored
        return copy.deepcopy(stored)

    def version_of(self, path: str) -> str:
        return str(self.leases[path]["metadata"]["resourceVersion"])

    def spec(self) -> dict[str, Any]:
        return dict(self.leases[PATH]["spec"])


def elector(api: FakeApi, clock: Clock, identity: str, changes: list[Any] | None = None) -> Elector:
    election = Election(namespace="ops", name="op", identity=identity)
    record = changes.append if changes is not None else lambda leading: None
    return Elector(api, election, clock=clock, wall=clock.wall, changed=record)


def advance(clock: Clock, seconds: float, *electors: Elector) -> None:
    """Let `seconds` pass in retry periods of 2 s, each elector trying once per period."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 2.0)
        for one in electors:
            one.step()


def test_the_first_replica_creates_the_lease_and_leads_and_the_second_stands_by() -> None:
    api, clock, changes = FakeApi(), Clock(), []
    a, b = elector(api, clock, "a", changes), elector(api, clock, "b")
    assert a.step() and not b.step()
    spec = api.spec()
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15
    assert spec["acquireTime"] == spec["renewTime"] == "2026-01-01T00:16:40.000000Z"
    assert spec["leaseTransitions"] == 0
    # The leader renews every retry period; the standby, seeing the Lease change, waits on.
    advance(clock, 60, a, b)
    assert a.leading() and not b.leading() and changes == [True]
    renewed = api.spec()
    assert renewed["holderIdentity"] == "a" and renewed["acquireTime"] == spec["acquireTime"]
    assert renewed["renewTime"] == "2026-01-01T00:17:40.000000Z"
    assert renewed["leaseTransitions"] == 0


def test_the_standby_takes_a_lease_over_once_it_expired_by_its_own_clock() -> None:
    api, clock = FakeApi(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    a.step()
    advance(clock, 6, a, b)
    last_renewal = clock.now
    # The leader is killed: nothing renews the Lease any more.
    advance(clock, 14, b)
    assert not b.leading(), "took the Lease before it expired"
    advance(clock, 2, b)
    assert b.leading() and clock.now - last_renewal <= 15 + 2
    spec = api.spec()
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"]


def test_a_standby_trusts_its_own_clock_not_the_renew_time_written() -> None:
    api, clock = FakeApi(), Clock()
    a = elector(api, clock, "a")
    a.step()
    # A leader whose clock is an hour behind writes renew times long past: the Lease still
    # counts as held for a lease duration from when the standby saw it change.
    api.leases[PATH]["spec"]["renewTime"] = "2025-12-31T23:00:00.000000Z"
    b = elector(api, clock, "b")
    advance(clock, 14, b)
    assert not b.leading()


def test_a_leader_that_cannot_renew_steps_down_before_anyone_may_take_over() -> None:
    api, clock, changes = FakeApi(), Clock(), []
    a, b = elector(api, clock, "a", changes), elector(api, clock, "b")
    a.step()
    b.step()
    renewed = clock.now
    api.down = True  # the leader is cut off from the API server; so is b's view for a while
    advance(clock, 8, a)
    assert a.leading()
    advance(clock, 2, a)
    assert not a.leading() and changes == [True, False]  # 10 s: the renew deadline
    stepped_down = clock.now
    api.down = False
    advance(clock, 4, b)
    assert not b.leading()  # 14 s since b saw the last renewal
    advance(clock, 2, b)
    assert b.leading() and stepped_down - renewed < clock.now - renewed
    # The old leader, back, sees another holder and stays a standby.
    advance(clock, 10, a, b)
    assert b.leading() and not a.leading() and changes == [True, False]


def test_of_two_replicas_writing_the_same_version_one_wins() -> None:
    api, clock = FakeApi(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    a.step()
    a.release()
    # b read the released Lease; c writes it first: b's replace is refused (409).
    c = elector(api, clock, "c")
    api.meddle = c.step
    assert not b.step()
    assert c.leading() and api.spec()["holderIdentity"] == "c"


def test_a_released_lease_is_taken_at_once() -> None:
    api, clock, changes = FakeApi(), Clock(), []
    a, b = elector(api, clock, "a", changes), elector(api, clock, "b")
    a.step()
    b.step()
    a.stop()
    assert not a.leading() and changes == [True, False]
    assert api.spec()["holderIdentity"] is None and api.spec()["leaseDurationSeconds"] == 1
    clock.now += 2
    assert b.step()
    assert api.spec()["holderIdentity"] == "b" and api.spec()["leaseTransitions"] == 1


def test_an_unreachable_api_server_or_an_odd_answer_does_not_end_the_campaign() -> None:
    """With the real client, a refused connection is an attempt that failed (urllib3's own
    errors ended the campaign's thread once: a standby that never took over); and whatever else
    an attempt raises, the next one comes a retry period later."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = Elector(JsonApi(f"http://127.0.0.1:{port}"), Election("ops", "op", "a"))
    assert not unreachable.step() and not unreachable.leading()

    class Garbled(FakeApi):
        def __init__(self) -> None:
            super().__init__()
            self.garbled = 2

        def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
            if self.garbled:
                self.garbled -= 1
                raise ValueError("an answer that is not JSON")
            return super().request(method, path, body)

    api = Garbled()
    timings = {"lease_duration": 3.0, "renew_deadline": 2.0, "retry_period": 0.05}
    campaign = Elector(api, Election("ops", "op", "a", **timings))
    campaign.start()
    try:
        wait_until(campaign.leading, 10, "the campaign leading after garbled answers", 0.05)
        assert campaign.leading() and api.garbled == 0 and api.spec()["holderIdentity"] == "a"
    finally:
        campaign.stop()
    assert api.spec()["holderIdentity"] is None  # released on stop


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"identity": ""}, "identity is empty"),
        ({"renew_deadline": 20.0}, "renew deadline (20s) < lease duration (15s)"),
        ({"retry_period": 0.0}, "0 < retry period (0s)"),
    ],
)
def test_an_election_refuses_timings_that_would_let_two_lead(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Election(**{"namespace": "ops", "name": "op", "identity": "a", **fields})


def test_the_flags_default_to_the_pods_namespace_and_name_and_refuse_bad_timings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    monkeypatch.setenv("POD_NAME", "op-7d9f-x2k4p")
    parser_args = ["--all-namespaces", "--leader-elect"]
    monkeypatch.setattr(main.kopf, "run", lambda **_: pytest.fail("kopf ran"))
    with pytest.raises(SystemExit) as exited:
        main.main([*parser_args, "--leader-elect-renew-deadline=20"])
    assert exited.value.code == 2
    assert "renew deadline (20s) < lease duration (15s)" in capsys.readouterr().err
    election = main.election_of(main.parser().parse_args(parser_args))
    assert (election.namespace, election.name) == ("ops", "liveshard-operator")
    assert election.identity.startswith("op-7d9f-x2k4p_") and len(election.identity) == 22
    assert (election.lease_duration, election.renew_deadline, election.retry_period) == (15, 10, 2)
