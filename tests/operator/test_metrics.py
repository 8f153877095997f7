"""The operator's metrics: each pass and its stages timed and a failed pass counted, a job's
members by their agents' phase, its reconfiguration in flight, the jobs by phase, a gone job's
series removed, the registry served over HTTP, and `liveshard-operator --metrics-port`. Against
hand-built decisions and the fakes of test_act; no cluster, no agent."""

from __future__ import annotations

import logging
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import kopf
import pytest
from liveshard_operator import controller as controller_module
from liveshard_operator import handlers
from liveshard_operator import main as main_module
from liveshard_operator.controller import JobController
from liveshard_operator.decision import Decision
from liveshard_operator.metrics import MEMBER_PHASES, STAGES, Metrics
from liveshard_operator.world import Record
from prometheus_client import generate_latest

from liveshard_core.logs import JsonFormatter
from tests.operator.test_act import Calls, FakeAgent, FakeKube
from tests.operator.test_decide import GROW, W2
from tests.operator.values import BODY, NOW, job, pod, seen, standby, starting, training

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def members(metrics: Metrics, job_: str) -> dict[str, float | None]:
    """The job's member gauge, by phase (None: no series)."""
    name = "liveshard_operator_members"
    return {phase: value(metrics, name, job=job_, phase=phase) for phase in MEMBER_PHASES}


def test_each_pass_is_timed_and_a_pass_that_raised_is_counted() -> None:
    metrics = Metrics()
    with metrics.timing("ns/a"):
        pass
    with pytest.raises(RuntimeError), metrics.timing("ns/a"):
        raise RuntimeError("the API server is away")
    assert value(metrics, "liveshard_operator_reconcile_seconds_count", job="ns/a") == 2
    assert value(metrics, "liveshard_operator_reconcile_errors_total", job="ns/a") == 1
    assert value(metrics, "liveshard_operator_reconcile_seconds_count", job="ns/b") is None


def test_members_are_counted_by_their_agents_phase_and_gone_pods_not_at_all() -> None:
    metrics = Metrics()
    pods = seen(
        pod("p0", training(1)), pod("p1", training(1)), pod("p2", standby()),
        pod("p3", starting()), pod("p4", None), pod("p5", training(1), gone=True),
    )  # fmt: skip
    metrics.decided("ns/tiny", Decision(job(4), pods, NOW, Record()))
    assert members(metrics, "ns/tiny") == {
        "starting": 1, "standby": 1, "joining": 0, "training": 2,
        "done": 0, "failed": 0, "broken": 0, "unknown": 1,
    }  # fmt: skip
    assert value(metrics, "liveshard_operator_reconfigurations_in_flight", job="ns/tiny") == 0
    assert value(metrics, "liveshard_operator_jobs", phase="Pending") == 1


def test_a_reconfiguration_in_flight_reads_1_until_the_record_has_none() -> None:
    metrics = Metrics()
    pods = seen(pod("p0", training(1)), pod("p1", training(1)), pod("p2", standby()))
    metrics.decided("ns/tiny", Decision(job(3), pods, NOW, Record(world=W2, in_flight=GROW)))
    assert value(metrics, "liveshard_operator_reconfigurations_in_flight", job="ns/tiny") == 1
    assert value(metrics, "liveshard_operator_jobs", phase="Reconfiguring") == 1
    metrics.decided("ns/tiny", Decision(job(3), pods, NOW, Record(world=GROW.new)))
    assert value(metrics, "liveshard_operator_reconfigurations_in_flight", job="ns/tiny") == 0
    # The job left Reconfiguring: that phase reads 0 rather than vanishing.
    assert value(metrics, "liveshard_operator_jobs", phase="Reconfiguring") == 0
    assert value(metrics, "liveshard_operator_jobs", phase="Running") == 1


def test_an_unobserved_pass_keeps_the_phase_and_drops_stale_members() -> None:
    metrics = Metrics()
    metrics.decided("ns/tiny", Decision(job(1), seen(pod("p0", training(1))), NOW, Record()))
    metrics.unobserved("ns/tiny", "Succeeded")
    assert set(members(metrics, "ns/tiny").values()) == {None}
    assert value(metrics, "liveshard_operator_reconfigurations_in_flight", job="ns/tiny") is None
    assert value(metrics, "liveshard_operator_jobs", phase="Succeeded") == 1
    assert value(metrics, "liveshard_operator_jobs", phase="Pending") == 0


def test_a_forgotten_job_leaves_no_series_and_the_others_keep_theirs() -> None:
    metrics = Metrics()
    for name in ("ns/a", "ns/b"):
        with metrics.timing(name):
            metrics.decided(name, Decision(job(1), seen(pod("p0", standby())), NOW, Record()))
    metrics.forget("ns/a")
    metrics.forget("ns/a")  # a controller closed after its job is gone forgets it twice
    text = _exposition(metrics)
    assert 'job="ns/a"' not in text and 'job="ns/b"' in text
    assert value(metrics, "liveshard_operator_jobs", phase="Pending") == 1
    assert members(metrics, "ns/b")["standby"] == 1


def test_the_controller_records_each_pass_and_forgets_its_job_once_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    calls: Calls = []

    def observe(*_: Any) -> Any:
        time.sleep(0.05)  # the agents are slow to answer
        return pods

    monkeypatch.setattr(controller_module, "observe", observe)
    kube = FakeKube(calls, BODY)
    metrics = Metrics()
    controller = JobController(kube, "ns", "tiny", lambda *_: None, metrics)  # type: ignore[arg-type]
    controller.clients.update({m: FakeAgent(m, calls) for m in pods.pods})  # type: ignore[misc]
    assert controller.reconcile()
    assert value(metrics, "liveshard_operator_reconcile_seconds_count", job="ns/tiny") == 1
    stage = "liveshard_operator_pass_stage_seconds"
    for name in STAGES:  # each stage of the pass timed once, the slow one where it was slow
        assert value(metrics, f"{stage}_count", job="ns/tiny", stage=name) == 1
    assert value(metrics, f"{stage}_sum", job="ns/tiny", stage="observe") >= 0.05  # type: ignore[operator]
    total = value(metrics, "liveshard_operator_reconcile_seconds_sum", job="ns/tiny")
    parts = [value(metrics, f"{stage}_sum", job="ns/tiny", stage=name) for name in STAGES]
    assert sum(parts) <= total  # type: ignore[arg-type]
    assert value(metrics, "liveshard_operator_reconcile_errors_total", job="ns/tiny") == 0
    assert members(metrics, "ns/tiny")["standby"] == 4
    assert value(metrics, "liveshard_operator_jobs", phase="Pending") == 1

    def away(namespace: str, name: str) -> dict[str, Any] | None:
        raise ConnectionError("the API server is away")

    monkeypatch.setattr(kube, "get_job", away)
    with pytest.raises(ConnectionError):
        controller.reconcile()
    assert value(metrics, "liveshard_operator_reconcile_errors_total", job="ns/tiny") == 1
    assert value(metrics, "liveshard_operator_reconcile_seconds_count", job="ns/tiny") == 2

    monkeypatch.setattr(kube, "get_job", lambda *_: None)
    assert not controller.reconcile()
    assert 'job="ns/tiny"' not in _exposition(metrics)
    assert value(metrics, "liveshard_operator_jobs", phase="Pending") == 0


def test_the_registry_is_served_at_slash_metrics() -> None:
    metrics = Metrics()
    metrics.unobserved("ns/tiny", "Running")
    server = metrics.serve("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'liveshard_operator_jobs{phase="Running"} 1.0' in text


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Where `liveshard-operator` serves its metrics, with kopf not run."""
    addresses: list[tuple[str, int]] = []
    monkeypatch.setattr(kopf, "run", lambda **_: None)
    monkeypatch.setattr(handlers.METRICS, "serve", lambda *where: addresses.append(where))
    return addresses


def test_the_command_serves_metrics_on_port_9401_unless_told_otherwise(
    served: list[tuple[str, int]],
) -> None:
    assert main_module.main(["--all-namespaces"]) == 0
    main_module.main(["--namespace=a", "--metrics-port=9500", "--metrics-address=10.0.0.7"])
    main_module.main(["--all-namespaces", "--metrics-port=0"])
    assert served == [("0.0.0.0", 9401), ("10.0.0.7", 9500)]


@pytest.mark.parametrize("port", ["65536", "-1", "metrics"])
def test_the_command_refuses_a_metrics_port_that_is_no_port(
    served: list[tuple[str, int]], port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main_module.main(["--all-namespaces", f"--metrics-port={port}"])
    assert exit_.value.code == 2
    assert f"--metrics-port: '{port}' is not a port number in 0..65535" in capsys.readouterr().err
    assert served == []


def test_a_taken_metrics_port_is_logged_and_the_operator_runs_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[bool] = []
    monkeypatch.setattr(kopf, "run", lambda **_: ran.append(True))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING):
            main_module.main(["--all-namespaces", f"--metrics-port={port}",
                              "--metrics-address=127.0.0.1"])  # fmt: skip
    assert ran == [True]
    assert f"no metrics: cannot serve on 127.0.0.1:{port}" in caplog.text


def test_every_series_the_operator_exports_is_in_docs_metrics_md() -> None:
    metrics = Metrics()
    with metrics.timing("ns/tiny"), metrics.stage("ns/tiny", "decide"):
        metrics.decided("ns/tiny", Decision(job(1), seen(pod("p0", standby())), NOW, Record()))
    metrics.reconcile_errors.labels("ns/tiny").inc()
    names = {  # a histogram by its own name; `_created` samples are prometheus_client's
        re.sub(r"_(bucket|sum|count)$", "", sample.name)
        for family in metrics.registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }
    documented = re.findall(r"^\| `(liveshard_operator_\w+)` \|", DOC.read_text(), re.MULTILINE)
    assert names == set(documented)


def _exposition(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_the_command_logs_json_lines_when_told(served: list[tuple[str, int]]) -> None:
    def formats() -> list[bool]:
        return [isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers]

    main_module.main(["--all-namespaces", "--log-format=json"])
    assert formats().count(True) == 1
    main_module.main(["--all-namespaces"])
    assert formats().count(True) == 0
