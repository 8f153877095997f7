"""kopf's handlers: a thread per ElasticTrainingJob runs its controller; events on the job and its
pods only wake it (level-based: the controller looks at everything again on every pass). Every
controller records into the operator's one `METRICS`, which `main` serves.

The loops are threads of this module's own, started and stopped by the jobs' watch events, not
kopf daemons: kopf puts a finalizer on every object a daemon serves, and a job must stay deletable
when the operator is gone (its pods, Secret and PodDisruptionBudget go by owner reference). With
leader election (`ELECTOR`), every replica watches and keeps its loops, but only the leader's
passes run.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf

from .act import Options
from .controller import JobController
from .kube import Kube, Throttled
from .leader import Elector
from .metrics import Metrics
from .render import GROUP, JOB_LABEL, PLURAL, VERSION

log = logging.getLogger(__name__)

PERIOD = 2.0  # seconds between passes when nothing wakes the controller
STOP_TIMEOUT = 10.0  # seconds the loops get to end their passes when the operator stops
METRICS = Metrics()
ELECTOR: Elector | None = None  # set by `main` with --leader-elect; None: this replica leads
OPTIONS = Options()  # what `main`'s flags ask of every job
_kube: Kube | None = None
_loops: dict[tuple[str, str], JobLoop] = {}
_lock = threading.Lock()


def api() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube.from_environment()
    return _kube


def leading() -> bool:
    return ELECTOR is None or ELECTOR.leading()


def _post_event(job: dict[str, Any], kind: str, reason: str, message: str) -> None:
    # kopf reads only the object reference (kind, name, namespace, uid) of the body.
    kopf.event(job, type=kind, reason=reason, message=message)  # type: ignore[arg-type]


class JobLoop:
    """The control loop of one job (by uid), in its own thread, until the job is gone or `stop`.
    The thread runs in the context of the kopf handler that started it, so that `kopf.event`
    works from it."""

    def __init__(self, namespace: str, name: str, uid: str) -> None:
        self.namespace, self.name, self.uid = namespace, name, uid
        self.wake, self.stopped = threading.Event(), threading.Event()
        self.gone = False  # the job was deleted: its agents are discarded as the loop ends
        self.controller: JobController | None = None  # once the thread runs
        context = contextvars.copy_context()
        self.thread = threading.Thread(
            target=context.run, args=(self._run,), name=f"job {namespace}/{name}", daemon=True
        )

    def own_write(self, version: str | None) -> bool:
        """Whether `version` of the job is the one its last pass wrote while leaving a
        reconfiguration in flight: the wait after that pass follows a member of it, so the
        write's watch event wakes nothing (a pass that wakes itself at every write would run
        back to back through a whole reconfiguration, asking every agent each time)."""
        quiet = self.controller.executor.quiet if self.controller is not None else None
        return version is not None and version == quiet

    def stop(self, gone: bool = False) -> None:
        """End the loop; `gone`: because the job was deleted (or replaced), so its agents are
        discarded (`JobController.discard`), not left for another operator to take over."""
        self.gone = self.gone or gone
        self.stopped.set()
        self.wake.set()

    def _run(self) -> None:
        controller = self.controller = JobController(
            api(), self.namespace, self.name, _post_event, METRICS, OPTIONS
        )
        not_before = 0.0  # a throttled pass's Retry-After: no pass before it, woken or not
        try:
            while not self.stopped.is_set():
                if self.stopped.wait(max(0.0, not_before - time.monotonic())):
                    break
                self.wake.clear()
                period = PERIOD
                if leading():
                    try:
                        if not controller.reconcile():
                            self.gone = True
                            return
                    except Throttled as err:  # the pass is retried, no sooner than it asks
                        period = max(PERIOD, err.retry_after)
                        not_before = time.monotonic() + err.retry_after
                        log.warning("reconcile of %s/%s throttled by the API server (%s %s); "
                                    "the next pass in %.0f s", self.namespace, self.name,
                                    err.method, err.path, period)  # fmt: skip
                    except Exception as err:  # a failed pass is logged and retried, never fatal
                        log.exception("reconcile of %s/%s failed: %s", self.namespace, self.name,
                                      err)  # fmt: skip
                else:  # the leader may change the job's objects meanwhile
                    controller.executor.recheck()
                controller.wait(self.wake, period)
        finally:
            if self.gone and leading():
                controller.discard()
            controller.close()
            with _lock:
                if _loops.get((self.namespace, self.name)) is self:
                    del _loops[(self.namespace, self.name)]


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_changed(
    *, type: str | None, name: str, namespace: str | None, uid: str, body: Mapping[str, Any],
    **_: Any,
) -> None:  # fmt: skip
    """Start the job's loop when the watch first lists or sees it, wake it on any change (its
    spec scaled, say) but its own quiet writes (`JobLoop.own_write`), stop it when the job is
    deleted or replaced by one of the same name."""
    assert namespace is not None  # the resource is namespaced
    key = (namespace, name)
    with _lock:
        loop = _loops.get(key)
        if loop is not None and (type == "DELETED" or loop.uid != uid):
            loop.stop(gone=True)
            del _loops[key]
            loop = None
        if type == "DELETED":
            return
        if loop is None:
            loop = _loops[key] = JobLoop(namespace, name, uid)
            loop.thread.start()
    if not loop.own_write((body.get("metadata") or {}).get("resourceVersion")):
        loop.wake.set()


@kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT})
def pod_changed(*, labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    loop = loop_of(namespace or "", labels[JOB_LABEL])
    if loop is not None:
        loop.wake.set()


def loop_of(namespace: str, name: str) -> JobLoop | None:
    """The job's running loop, if any."""
    return _loops.get((namespace, name))


def wake_all(leads: bool = True) -> None:
    """Wake every loop (the Elector's callback: a new leader starts its passes at once); the
    leader gauge says whether this replica leads."""
    METRICS.leader.set(1 if leads else 0)
    if leads:
        with _lock:
            for loop in _loops.values():
                loop.wake.set()


@kopf.on.cleanup()
def stop_all(**_: Any) -> None:
    """On shutdown: end every loop's pass, then give the Lease up for a standby to take."""
    with _lock:
        loops = list(_loops.values())
    for loop in loops:
        loop.stop()
    deadline = time.monotonic() + STOP_TIMEOUT
    for loop in loops:
        loop.thread.join(max(0.0, deadline - time.monotonic()))
    if ELECTOR is not None:
        ELECTOR.stop()
