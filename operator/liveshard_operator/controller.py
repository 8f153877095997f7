"""The level-based reconcile loop of one job: each pass reads the job, parses its spec, observes
its pods and agents, decides the next idempotent step (`decide`, pure) and carries it out (`act`),
writing the job's status once.

Everything the next pass needs is in the job's status (`world.Record`), so a restarted operator
resumes where the last one stopped; handlers only wake this loop. Each pass is timed and what it
found recorded in the operator's metrics (`metrics.Metrics`), which the job leaves when it is
gone or its controller is closed.

The status is written only over the version of the job the pass read: when the job changed
meanwhile (its spec scaled, another replica's write), the pass ends there and the next one reads
it again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from liveshard_core.errors import InvalidInput

from . import publish, sentinel
from .act import DEFAULTS, Executor, Options
from .agents import AgentClient, AgentError, fan_out
from .certificates import CertificatesPending
from .conditions import Conditions
from .decide import decide
from .kube import Events, Kube, Stale
from .metrics import Metrics
from .observation import Job
from .observe import observe
from .spec import JobSpec
from .world import Record

log = logging.getLogger(__name__)

# Earlier operators ran each job's loop as a kopf daemon, and kopf put this finalizer on every job
# a daemon served; a pass takes it off, so that a job stays deletable once the operator is gone.
LEGACY_FINALIZER = "liveshard.io/finalizer"
# Seconds before the next pass sends again a Prepare or commit that an agent did not take for
# now (unavailable, past its deadline): a reconfiguration waits on every member's Prepare. Each
# further pass in a row that leaves one unsent doubles the wait (up to the period), so that
# agents too loaded to answer in time are not sent more calls the sooner for it.
RESEND = 0.5
# A pass that leaves nothing in flight is followed by a wait of at least this many times its own
# length (a watch event still ends it): passes with nothing to do take at most a fifth of the
# operator's time at any size (such a pass asks every agent its status: at 1024 members, a second).
IDLE_STRETCH = 4


class JobController:
    """Reconciles one ElasticTrainingJob; `reconcile` is one pass."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        events: Events,
        metrics: Metrics | None = None,
        options: Options = DEFAULTS,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.clients: dict[str, AgentClient] = {}  # one per pod, kept across passes
        self.executor = Executor(kube, namespace, name, events, self.clients, options)
        self.metrics = metrics or Metrics()  # the operator's, or one of its own nobody serves
        self.job = f"{namespace}/{name}"  # its `job` label
        # The member of a reconfiguration in flight that the wait after the pass follows: None
        # when nothing is in flight, or no member can be followed.
        self.watched: sentinel.Follow | None = None
        self.in_flight = False  # the last pass left a reconfiguration in flight
        self.spent = 0.0  # the last pass's wall time (seconds)
        self.unsent_passes = 0  # the passes in a row, to the last, that left a call unsent

    def discard(self) -> None:
        """The job is gone: tell every agent a pass reached to drop its state and exit, so that
        its pod, which the garbage collector is deleting, ends now instead of at the end of its
        grace period (an agent keeps training through SIGTERM, waiting to be drained)."""

        def discard(item: tuple[str, AgentClient]) -> None:
            member, client = item
            try:
                client.release(discard=True)
            except AgentError as err:  # gone already, or never came up: nothing to end
                log.info("job %s: discarding %s: %s", self.job, member, err)

        fan_out(discard, list(self.clients.items()))
        if self.clients:
            log.info("job %s is gone: %d agents discarded", self.job, len(self.clients))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()
        self.metrics.forget(self.job)

    def wait(self, wake: threading.Event, seconds: float) -> None:
        """The wait after a pass: until `wake` is set or `seconds` passed (`RESEND` at most when
        a Prepare or commit of the pass failed where the agent may answer later, doubled for
        each pass before it in a row that did so), or, while a reconfiguration is in flight, its
        watched member's verdict changed (`sentinel`); with nothing in flight, `IDLE_STRETCH`
        times the pass's length at least."""
        if self.unsent_passes:
            seconds = min(seconds, RESEND * 2 ** (self.unsent_passes - 1))
        elif not self.in_flight:
            seconds = max(seconds, IDLE_STRETCH * self.spent)
        sentinel.wait(wake, seconds, self.watched)

    def reconcile(self) -> bool:
        """One pass, timed; False once the job is gone."""
        with self.metrics.timing(self.job) as timed:
            alive = self._reconcile()
        self.spent = timed.seconds
        self.unsent_passes = self.unsent_passes + 1 if self.executor.unsent else 0
        if not alive:
            self.metrics.forget(self.job)
        return alive

    def _reconcile(self) -> bool:
        self.watched, self.in_flight, self.executor.unsent = None, False, False
        body = self.kube.get_job(self.namespace, self.name)
        if body is None:
            return False
        self.executor.observed = body["metadata"].get("resourceVersion")
        try:
            return self._pass(body)
        except Stale:
            log.info("job %s: changed during the pass; the next pass reads it again", self.job)
            return True

    def _pass(self, body: dict[str, Any]) -> bool:
        if LEGACY_FINALIZER in (body["metadata"].get("finalizers") or ()):
            self.kube.remove_job_finalizer(body, LEGACY_FINALIZER)
            return True  # the job changed: the next pass reads it again
        status = body.get("status") or {}
        if Conditions(status.get("conditions") or [], 0).terminal():
            self.metrics.unobserved(self.job, str(status.get("phase") or "Unknown"))
            return True  # Succeeded and Failed are for good
        try:
            spec = JobSpec.parse(body["spec"])
            model = spec.model_spec()
        except (InvalidInput, KeyError, TypeError, ValueError) as err:
            return self._not_runnable(body, str(err))
        try:
            self.executor.ensure_objects(body, spec)
        except InvalidInput as err:  # the spec asks for what this cluster lacks
            return self._not_runnable(body, str(err))
        except CertificatesPending as err:  # cert-manager has not issued them yet
            return self._not_runnable(body, str(err), "CertificatesPending")
        token = self.executor.token()
        with self.metrics.stage(self.job, "observe"):
            seen = observe(
                self.kube, self.namespace, self.name, token, spec.port, self.clients,
                self.executor.certificates.client_tls,
            )  # fmt: skip
        self.executor.certificates.rotate(body, seen)
        record = Record.from_status(status)
        with self.metrics.stage(self.job, "decide"):
            # The time is read once, after observing, so that every rule sees the same.
            decision = decide(seen, record, Job(body, spec, model), time.time())
        with self.metrics.stage(self.job, "act"):
            plan = self.executor.run(decision).record.in_flight
        self.in_flight = plan is not None
        self.watched = sentinel.follow(plan, seen, self.clients) if plan else None
        # As decided: a reconfiguration this pass begins counts as in flight from the next pass.
        self.metrics.decided(self.job, decision)
        return True

    def _not_runnable(self, body: dict[str, Any], error: str, reason: str = "InvalidSpec") -> bool:
        """Report a job that cannot be run (it stays Pending until its spec changes, or, for
        `reason` CertificatesPending, until its certificates are issued)."""
        pending = publish.not_runnable(body, error, time.time(), reason)
        self.executor.write(pending)
        self.metrics.unobserved(self.job, pending["phase"])
        return True
