"""The agent's Prometheus metrics: training progress, the member's phase and what each
reconfiguration, checkpoint, breakage and refusal cost, served at `/metrics` on a port of its own.

`Metrics` turns the member loop's events (`runtime.events`) and the agent's phase (`status.Phase`)
into series labelled with the job and the member (docs/metrics.md lists them). Each instance owns
its registry, never prometheus_client's global one, so several agents in one process keep theirs
apart. This module must not drive the member or read the status board.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from liveshard_core.job import Result, TrainingSettings
from liveshard_core.policy.rebalance import imbalance

from ..runtime.events import (
    Broke,
    Checkpointed,
    CheckpointFailed,
    Decided,
    Event,
    Finished,
    Refused,
    Stepped,
    Switched,
    Undecided,
)
from .status import Phase

_LABELS = ("job", "member")
# A step of a tiny model on a CPU takes milliseconds, one of a large model seconds.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)
# Reconfigurations and checkpoints: from a fraction of a second to the deadlines' minutes.
_LONG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
_BYTE_BUCKETS = tuple(float(4**k * 1024) for k in range(14))  # 1 KiB .. 64 GiB


class Metrics:
    """The series of one agent, in `registry`; `report` takes the loop's events, `set_phase`
    the agent's phase."""

    def __init__(self, job: str, member: str, settings: TrainingSettings) -> None:
        self.registry = CollectorRegistry()
        self._global_batch = settings.global_batch
        self._tokens_per_step = settings.global_batch * settings.seq_len
        labels = {"job": job, "member": member}

        def gauges(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return gauges(name, doc).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            series = Histogram(name, doc, _LABELS, registry=self.registry, buckets=buckets)
            return series.labels(**labels)

        self.step = gauge("liveshard_step", "The last step this member trained.")
        # Series of a trained step, exported from the first and dropped when the member stands
        # by: one that has no step of the job's (standing by, joining) exports none, so that
        # neither a 0 nor a stale value enters a job's average.
        self._labels = labels
        self._loss = gauges("liveshard_loss", "The loss of the last step.")
        self._tokens_per_second = gauges(
            "liveshard_tokens_per_second", "The job's tokens of the last step over its seconds."
        )
        self.step_seconds = histogram(
            "liveshard_step_seconds", "Seconds each step took on this member.", _STEP_BUCKETS
        )
        self.exchange_seconds = histogram(
            "liveshard_peer_exchange_seconds",
            "Seconds of each step spent sending and receiving the gradients of the copies peers "
            "hold (mirrored layouts without replicas).",
            _STEP_BUCKETS,
        )
        self.samples = counter(
            "liveshard_samples_total", "Samples the job consumed in the steps this member trained."
        )
        self.pause_seconds = histogram(
            "liveshard_reconfiguration_pause_seconds",
            "The training pause each reconfiguration exposed (the world's longest).",
            _LONG_BUCKETS,
        )
        self.reconfiguration_bytes = histogram(
            "liveshard_reconfiguration_bytes",
            "Bytes each reconfiguration's plan moves over the network.",
            _BYTE_BUCKETS,
        )
        self.prepare_seconds = histogram(
            "liveshard_prepare_seconds",
            "Seconds from a reconfiguration's request to prepared, on this member.",
            _LONG_BUCKETS,
        )
        self.imbalance = gauge(
            "liveshard_pipeline_imbalance",
            "The last step's slowest pipeline stage over the mean stage, in measured compute "
            "seconds (1: balanced).",
        )
        self.checkpoints = counter("liveshard_checkpoints_total", "Checkpoints saved.")
        self.checkpoint_seconds = histogram(
            "liveshard_checkpoint_seconds", "Seconds each checkpoint took to save.", _LONG_BUCKETS
        )
        self.checkpoint_failures = counter(
            "liveshard_checkpoint_failures_total", "Checkpoints that could not be saved."
        )
        self.breaks = counter("liveshard_world_breaks_total", "Worlds that broke under it.")
        self.refusals = counter("liveshard_refusals_total", "Commands this member refused.")
        reconfigurations = Counter(
            "liveshard_reconfigurations_total",
            "Reconfigurations this member settled, by result (committed or aborted).",
            (*_LABELS, "result"), registry=self.registry,
        )  # fmt: skip
        self._reconfigurations = {
            r: reconfigurations.labels(**labels, result=r.value) for r in Result
        }
        phases = Gauge(
            "liveshard_member_phase", "1 for the agent's current phase, 0 for the others.",
            (*_LABELS, "phase"), registry=self.registry,
        )  # fmt: skip
        self._phases = {p: phases.labels(**labels, phase=p.name.lower()) for p in Phase}
        self.set_phase(Phase.STARTING)

    def report(self, event: Event) -> None:
        """Count and time one event of the member's loop."""
        match event:
            case Stepped(record=record):
                self.step.set(record.step)
                self._loss.labels(**self._labels).set(record.loss)
                if record.seconds > 0:
                    tokens = self._tokens_per_step / record.seconds
                    self._tokens_per_second.labels(**self._labels).set(tokens)
                self.step_seconds.observe(record.seconds)
                if record.exchange_seconds > 0:
                    self.exchange_seconds.observe(record.exchange_seconds)
                self.samples.inc(self._global_batch)
                if record.costs.layers and event.pp_layers:
                    self.imbalance.set(imbalance(record.costs, event.pp_layers))
            case Switched():
                self._reconfigurations[event.result].inc()
                self.pause_seconds.observe(event.pause_seconds)
                self.reconfiguration_bytes.observe(event.network_bytes)
                self.prepare_seconds.observe(event.prepare_seconds)
            case Checkpointed():
                self.checkpoints.inc()
                self.checkpoint_seconds.observe(event.seconds)
            case CheckpointFailed():
                self.checkpoint_failures.inc()
            case Broke():
                self.breaks.inc()
            case Refused():
                self.refusals.inc()
            case Finished() | Decided() | Undecided():
                pass  # the phase, or the pending state, says so

    def set_phase(self, phase: Phase) -> None:
        for each, series in self._phases.items():
            series.set(1 if each is phase else 0)
        if phase is Phase.STANDBY:  # out of the world: its last step is not the job's
            for trained in (self._loss, self._tokens_per_second):
                trained.remove(*(self._labels[name] for name in _LABELS))
