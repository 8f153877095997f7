"""The operator's Prometheus metrics: how long each reconcile pass and each of its stages took
and whether it failed, each job's members by their agents' phase, whether a reconfiguration is in
flight, and the jobs by phase, served at `/metrics` on a port of its own.

`Metrics` takes what a pass saw and decided (`JobController` calls it; docs/metrics.md lists the
series). A job's series are labelled `job` = namespace/name and removed when the job's
controller stops. Each instance owns its registry, never prometheus_client's global one, so
tests keep theirs apart. This module must not call the API server or an agent.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from liveshard.v1 import agent_pb2 as pb

from .decision import Decision

DEFAULT_PORT = 9401
UNKNOWN = "unknown"  # the phase of a member whose agent did not answer
# Every phase an agent reports, and `unknown`: a job's member gauge has each, zeros included.
MEMBER_PHASES = (
    *(name.lower() for name, number in pb.AgentStatus.Phase.items() if number),
    UNKNOWN,
)
# A pass reads the API server and asks agents within their deadlines: milliseconds to a minute.
_PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A pass's stages (`stage`): reading the pods and asking the agents, deciding, carrying it out.
STAGES = ("observe", "decide", "act")


@dataclass
class Timed:
    seconds: float = 0.0


class Metrics:
    """The operator's series, in `registry`. `timing` wraps a pass and `stage` each of its
    stages, `decided` and `unobserved` take what it found, `forget` drops a job that is gone."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            "liveshard_operator_reconcile_seconds", "Seconds each reconcile pass of a job took.",
            ("job",), registry=self.registry, buckets=_PASS_BUCKETS,
        )  # fmt: skip
        self.stage_seconds = Histogram(
            "liveshard_operator_pass_stage_seconds",
            "Seconds each stage of a job's reconcile passes took (observe, decide, act).",
            ("job", "stage"), registry=self.registry, buckets=_PASS_BUCKETS,
        )  # fmt: skip
        self.reconcile_errors = Counter(
            "liveshard_operator_reconcile_errors", "Reconcile passes of a job that raised.",
            ("job",), registry=self.registry,
        )  # fmt: skip
        self.members = Gauge(
            "liveshard_operator_members",
            "The job's pods that are not gone, by their agents' phase (unknown: no answer).",
            ("job", "phase"), registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "liveshard_operator_reconfigurations_in_flight",
            "1 while the job's record has a reconfiguration in flight, else 0.",
            ("job",), registry=self.registry,
        )  # fmt: skip
        self.jobs = Gauge(
            "liveshard_operator_jobs", "Jobs by the phase their last pass left in their status.",
            ("phase",), registry=self.registry,
        )  # fmt: skip
        self.leader = Gauge(
            "liveshard_operator_leader",
            "1 while this replica leads (holds the Lease, or runs without leader election).",
            registry=self.registry,
        )  # fmt: skip
        self.leader.set(1)
        self._lock = threading.Lock()  # each job's pass runs in a thread of its own
        self._phases: dict[str, str] = {}  # job -> the phase its last pass left
        self._known: set[str] = set()  # every phase a job has been in

    @contextmanager
    def timing(self, job: str) -> Iterator[Timed]:
        """Time the pass run inside (its seconds are in the `Timed` given, once it ends); count
        it as an error if it raises (and let it raise)."""
        errors = self.reconcile_errors.labels(job)  # 0 from the first pass, not the first error
        timed, start = Timed(), time.monotonic()
        try:
            yield timed
        except Exception:
            errors.inc()
            raise
        finally:
            timed.seconds = time.monotonic() - start
            self.reconcile_seconds.labels(job).observe(timed.seconds)

    @contextmanager
    def stage(self, job: str, stage: str) -> Iterator[None]:
        """Time one of a pass's `STAGES`, run inside (also when it raises)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.stage_seconds.labels(job, stage).observe(time.monotonic() - start)

    def decided(self, job: str, decision: Decision) -> None:
        """What a pass that observed the job found: its members' phases, whether its record has
        a reconfiguration in flight, and the phase its status will say."""
        phases = Tally(
            pb.AgentStatus.Phase.Name(pod.agent.phase).lower() if pod.agent else UNKNOWN
            for pod in decision.seen.pods.values()
            if not pod.gone
        )
        for phase in MEMBER_PHASES:
            self.members.labels(job, phase).set(phases[phase])
        self.in_flight.labels(job).set(1 if decision.record.in_flight else 0)
        self._set_phase(job, str(decision.status["phase"]))

    def unobserved(self, job: str, phase: str) -> None:
        """A pass that did not look at the job's pods (its spec is invalid, or it has finished):
        its phase, and no member or in-flight series rather than stale ones."""
        self._drop_members(job)
        self._set_phase(job, phase)

    def forget(self, job: str) -> None:
        """Remove every series of `job` (it is gone, or its controller stopped)."""
        self._drop_members(job)
        self.reconcile_seconds.remove(job)
        self.reconcile_errors.remove(job)
        for stage in STAGES:
            self.stage_seconds.remove(job, stage)
        with self._lock:
            self._phases.pop(job, None)
            self._count_phases()

    def serve(self, address: str, port: int) -> WSGIServer:
        """Serve the registry at http://address:port/metrics from a daemon thread; OSError if
        the port is taken or the address is not this host's."""
        server, _ = start_http_server(port, address, registry=self.registry)
        return server

    def _drop_members(self, job: str) -> None:
        for phase in MEMBER_PHASES:
            self.members.remove(job, phase)
        self.in_flight.remove(job)

    def _set_phase(self, job: str, phase: str) -> None:
        with self._lock:
            self._phases[job] = phase
            self._count_phases()

    def _count_phases(self) -> None:
        # A phase no job is in any more reads 0 rather than vanishing, as dashboards expect.
        counts = Tally(self._phases.values())
        self._known.update(counts)
        for phase in self._known:
            self.jobs.labels(phase).set(counts[phase])
