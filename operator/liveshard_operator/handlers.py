"""kopf's handlers: a daemon per ElasticTrainingJob runs its controller; events on the job's
pods only wake it (level-based: the controller looks at everything again on every pass). Every
controller records into the operator's one `METRICS`, which `main` serves.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import kopf

from .controller import JobController
from .kube import Kube
from .metrics import Metrics
from .render import GROUP, JOB_LABEL, PLURAL, VERSION

PERIOD = 2.0  # seconds between passes when nothing wakes the controller
_wakers: dict[tuple[str, str], threading.Event] = {}
_kube: Kube | None = None
METRICS = Metrics()


def _api() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube.from_environment()
    return _kube


def _post_event(job: dict[str, Any], kind: str, reason: str, message: str) -> None:
    # kopf reads only the object reference (kind, name, namespace, uid) of the body.
    kopf.event(job, type=kind, reason=reason, message=message)  # type: ignore[arg-type]


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
def run_job(
    *, name: str, namespace: str | None, stopped: kopf.DaemonStopped, logger: kopf.Logger, **_: Any
) -> None:
    """The job's control loop, until the job is deleted or the operator stops."""
    assert namespace is not None  # the resource is namespaced
    wake = _wakers.setdefault((namespace, name), threading.Event())
    controller = JobController(_api(), namespace, name, _post_event, METRICS)
    try:
        while not stopped:
            wake.clear()
            try:
                if not controller.reconcile():
                    return
            except Exception as err:  # a failed pass is logged and retried, never fatal
                logger.exception("reconcile of %s failed: %s", name, err)
            wake.wait(PERIOD)
    finally:
        controller.close()
        _wakers.pop((namespace, name), None)


@kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT})
def pod_changed(*, labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    wake = _wakers.get((namespace or "", labels[JOB_LABEL]))
    if wake is not None:
        wake.set()


@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.replicas")
def replicas_changed(*, name: str, namespace: str | None, **_: Any) -> None:
    wake = _wakers.get((namespace or "", name))
    if wake is not None:
        wake.set()
