"""The agent's Prometheus metrics: `Metrics` fed real events and read back through its own
registry (no process), the metrics port's configuration (no process), and one agent process whose
`/metrics` is scraped over HTTP while it trains a one-member job."""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the agent needs torch (the agent extra)")
pytest.importorskip("prometheus_client", reason="the agent's metrics (the agent extra)")

from prometheus_client.parser import text_string_to_metric_families

from liveshard.v1 import agent_pb2 as pb
from liveshard_agent.runtime.events import (
    Broke,
    Checkpointed,
    CheckpointFailed,
    Finished,
    Refused,
    Stepped,
    Switched,
)
from liveshard_agent.runtime.recovery import Breakage
from liveshard_agent.runtime.trainer import StepRecord
from liveshard_agent.server.config import ConfigError, load
from liveshard_agent.server.metrics import Metrics
from liveshard_agent.server.status import Phase
from liveshard_core.job import Result, TrainingSettings
from liveshard_core.policy.rebalance import StepCosts

from .agents import HOST, WAIT, agent_env, agents, free_port, layout
from .test_flow import change, host_store, switched, trains

SETTINGS = TrainingSettings(global_batch=4, micro_batch=1, seq_len=32)
JOB, MEMBER = "test-job", "solo"


def stepped(step: int, loss: float, seconds: float) -> Stepped:
    record = StepRecord(step=step, loss=loss, aux_loss=0.0, grad_norm=1.0, lr=1e-3,
                        seconds=seconds, samples=(), agreement=())  # fmt: skip
    return Stepped(MEMBER, 0, "dp=1", True, record)


def settled(result: Result, pause: float, prepare: float, network_bytes: int) -> Switched:
    return Switched(
        epoch=1, step=10, from_layout="dp=1", to_layout="dp=2", result=result, cause=None,
        reason="", pause_seconds=pause, prepare_seconds=prepare, network_bytes=network_bytes,
        report=True,
    )  # fmt: skip


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"job": JOB, "member": MEMBER, **labels})


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(JOB, MEMBER, SETTINGS)


def test_steps_set_the_progress_series(metrics: Metrics) -> None:
    """No process. A member that trained no step yet (standing by, joining) has no loss or
    rate: a 0 would pull the job's average down."""
    assert value(metrics, "liveshard_loss") is None
    assert value(metrics, "liveshard_tokens_per_second") is None
    assert value(metrics, "liveshard_step") == 0
    metrics.report(stepped(0, 5.0, 0.5))
    costs = StepCosts((1.0, 1.0, 1.0, 1.0))
    metrics.report(dataclasses.replace(
        stepped(1, 4.5, 0.25), record=dataclasses.replace(stepped(1, 4.5, 0.25).record,
                                                          costs=costs), pp_layers=(3, 1),
    ))  # fmt: skip
    assert value(metrics, "liveshard_pipeline_imbalance") == 1.5  # 3 s over a mean of 2
    assert value(metrics, "liveshard_step") == 1
    assert value(metrics, "liveshard_loss") == 4.5
    assert value(metrics, "liveshard_tokens_per_second") == 4 * 32 / 0.25
    assert value(metrics, "liveshard_samples_total") == 2 * 4
    assert value(metrics, "liveshard_step_seconds_count") == 2
    assert value(metrics, "liveshard_step_seconds_sum") == 0.75
    assert value(metrics, "liveshard_step_seconds_bucket", le="0.25") == 1
    assert value(metrics, "liveshard_step_seconds_bucket", le="0.5") == 2


def test_a_peers_exchange_is_timed_where_the_member_has_one(metrics: Metrics) -> None:
    """No process."""
    name = "liveshard_peer_exchange_seconds"
    metrics.report(stepped(0, 5.0, 0.5))  # no peers: no sample
    assert value(metrics, f"{name}_count") == 0
    exchanged = dataclasses.replace(stepped(1, 4.5, 0.5).record, exchange_seconds=0.004)
    metrics.report(dataclasses.replace(stepped(1, 4.5, 0.5), record=exchanged))
    assert value(metrics, f"{name}_count") == 1
    assert value(metrics, f"{name}_sum") == 0.004


def test_reconfigurations_are_counted_by_result_and_measured(metrics: Metrics) -> None:
    """No process."""
    reconfigurations = "liveshard_reconfigurations_total"
    assert value(metrics, reconfigurations, result="committed") == 0  # there before any
    assert value(metrics, reconfigurations, result="aborted") == 0
    metrics.report(settled(Result.COMMITTED, pause=1.5, prepare=3.0, network_bytes=5 * 1024))
    metrics.report(settled(Result.COMMITTED, pause=0.5, prepare=2.0, network_bytes=3 << 30))
    metrics.report(settled(Result.ABORTED, pause=0.0, prepare=4.0, network_bytes=0))
    assert value(metrics, reconfigurations, result="committed") == 2
    assert value(metrics, reconfigurations, result="aborted") == 1
    assert value(metrics, "liveshard_reconfiguration_pause_seconds_sum") == 2.0
    assert value(metrics, "liveshard_prepare_seconds_count") == 3
    assert value(metrics, "liveshard_prepare_seconds_sum") == 9.0
    moved = "liveshard_reconfiguration_bytes_bucket"
    assert value(metrics, moved, le="1024.0") == 1  # the abort's 0 bytes
    assert value(metrics, moved, le="4096.0") == 1
    assert value(metrics, moved, le="16384.0") == 2  # 5 KiB
    assert value(metrics, moved, le="4.294967296e+09") == 3  # 3 GiB, under 4 GiB
    assert value(metrics, moved, le="6.8719476736e+10") == 3  # the largest bucket: 64 GiB
    assert value(metrics, "liveshard_reconfiguration_bytes_sum") == 5 * 1024 + (3 << 30)


def test_checkpoints_breaks_and_refusals_are_counted(metrics: Metrics) -> None:
    """No process."""
    metrics.report(Checkpointed(number=1, step=4, path="/ckpt/1", seconds=2.0, report=True))
    metrics.report(Checkpointed(number=2, step=8, path="/ckpt/2", seconds=3.0, report=False))
    metrics.report(CheckpointFailed(3, 12, "/ckpt/3", "prepare: rank 0: disk full", report=True))
    metrics.report(Broke(MEMBER, 0, Breakage(step=9, whole=True, reason="a peer died")))
    metrics.report(Refused("Prepare", "epoch 1 is pending"))
    metrics.report(Finished(MEMBER, 10))
    assert value(metrics, "liveshard_checkpoints_total") == 2
    assert value(metrics, "liveshard_checkpoint_seconds_sum") == 5.0
    assert value(metrics, "liveshard_checkpoint_failures_total") == 1
    assert value(metrics, "liveshard_world_breaks_total") == 1
    assert value(metrics, "liveshard_refusals_total") == 1
    assert value(metrics, "liveshard_step") == 0  # no event but `Stepped` moves the step


def test_the_phase_gauge_is_one_for_the_current_phase_only(metrics: Metrics) -> None:
    """No process."""

    def phases() -> dict[str, float | None]:
        return {p.name.lower(): value(metrics, "liveshard_member_phase", phase=p.name.lower())
                for p in Phase}  # fmt: skip

    assert phases() == {p.name.lower(): float(p is Phase.STARTING) for p in Phase}
    metrics.set_phase(Phase.TRAINING)
    metrics.set_phase(Phase.BROKEN)
    assert phases() == {p.name.lower(): float(p is Phase.BROKEN) for p in Phase}
    # A member that trained, then left the world, exports no loss or rate of its own any more.
    metrics.report(stepped(1, 4.5, 0.25))
    assert value(metrics, "liveshard_loss") == 4.5
    metrics.set_phase(Phase.STANDBY)
    assert value(metrics, "liveshard_loss") is None
    assert value(metrics, "liveshard_tokens_per_second") is None
    metrics.set_phase(Phase.STANDBY)  # again: nothing to drop


def test_agents_in_one_process_keep_their_series_apart(metrics: Metrics) -> None:
    """No process: each `Metrics` has a registry of its own, never the global one."""
    other = Metrics(JOB, "other", SETTINGS)
    metrics.report(stepped(3, 2.0, 0.1))
    assert value(metrics, "liveshard_step") == 3
    labels = {"job": JOB, "member": "other"}
    assert other.registry.get_sample_value("liveshard_step", labels) == 0
    assert other.registry.get_sample_value("liveshard_step", {"job": JOB, "member": MEMBER}) is None


def test_the_metrics_port_is_configured_and_checked() -> None:
    """No process."""
    env = agent_env("a", 7070)
    assert load(env, []).metrics_port == 9400
    assert load({**env, "LIVESHARD_METRICS_PORT": "0"}, []).metrics_port == 0  # off
    assert load(env, ["--metrics-port", "9500"]).metrics_port == 9500
    for text, message in [
        ("http", "LIVESHARD_METRICS_PORT: 'http' must be a port number in 0..65535"),
        ("70000", "LIVESHARD_METRICS_PORT: '70000' must be a port number in 0..65535"),
        ("7070", "LIVESHARD_METRICS_PORT: 7070 is the API's port (LIVESHARD_PORT)"),
    ]:
        with pytest.raises(ConfigError) as err:
            load({**env, "LIVESHARD_METRICS_PORT": text}, [])
        assert str(err.value) == message


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample at http://HOST:port/metrics, by name and labels."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"job": JOB, "member": MEMBER, **labels}.items()))]


def test_an_agent_serves_metrics_that_move_while_it_trains(tmp_path: Path) -> None:
    """1 agent process, with metrics on a free port: a one-member job trains, changes its layout
    (zero=1), trains on; scraped twice."""
    port = free_port()
    with agents([MEMBER], tmp_path, LIVESHARD_METRICS_PORT=port) as started:
        solo = started[MEMBER]
        first_world, zeroed = layout([MEMBER]), layout([MEMBER], zero=1)
        solo.call("Prepare", pb.PrepareRequest(epoch=0, store=host_store(solo, 0), to=first_world))
        trains(solo, 1)
        solo.call("Prepare", change(1, host_store(solo, 1), first_world, zeroed))
        switched([solo], 1)
        trains(solo, solo.status().step)
        first = scrape(port)
        deadline = time.monotonic() + WAIT
        second = scrape(port)
        while sample(second, "liveshard_step") <= sample(first, "liveshard_step"):
            assert time.monotonic() < deadline, "the step did not rise between scrapes"
            time.sleep(0.2)
            second = scrape(port)
        assert solo.status().phase == pb.AgentStatus.TRAINING
    assert sample(first, "liveshard_step") >= 1
    assert sample(second, "liveshard_samples_total") > sample(first, "liveshard_samples_total")
    assert sample(second, "liveshard_step_seconds_count") > sample(
        first, "liveshard_step_seconds_count"
    )
    assert sample(second, "liveshard_tokens_per_second") > 0
    assert sample(second, "liveshard_loss") > 0
    for phase in Phase:
        expected = float(phase is Phase.TRAINING)
        assert sample(second, "liveshard_member_phase", phase=phase.name.lower()) == expected
    # The change to zero=1 (the first world is a start, no reconfiguration).
    assert sample(second, "liveshard_reconfigurations_total", result="committed") == 1
    assert sample(second, "liveshard_reconfigurations_total", result="aborted") == 0
    assert sample(second, "liveshard_prepare_seconds_count") == 1
    assert sample(second, "liveshard_refusals_total") == 0
