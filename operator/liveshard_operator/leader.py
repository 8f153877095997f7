"""Leader election on a `coordination.k8s.io/v1` Lease, as kube-controller-manager does it: of the
operator's replicas, the one named in the Lease's `holderIdentity` reconciles jobs; the others
stand by and take the Lease over once it expires.

The Lease is read and written with optimistic concurrency (a replace carries the
`resourceVersion` read; a 409 means another replica wrote first). A candidate judges expiry by its
own clock: a Lease is expired once its record has not changed for `leaseDurationSeconds` since this
replica first saw it, so clocks that disagree between nodes do not matter. The leader renews every
`retry_period` and steps down (`leading()` turns False) once it has not renewed for
`renew_deadline`, which is shorter than the lease duration: it stops before anyone may take over.

This module owns the Lease and nothing else: what leading permits is the handlers' business.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from .kube import ApiError

log = logging.getLogger(__name__)

API = "/apis/coordination.k8s.io/v1"


class LeaseApi(Protocol):
    """The one call the elector makes (`kube.JsonApi.request`)."""

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = ...,
        timeout: float | None = None,
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class Election:
    """Which Lease, who this replica is, and the timings (kube-controller-manager's defaults)."""

    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        for field in ("namespace", "name", "identity"):
            if not getattr(self, field):
                raise ValueError(f"leader election: {field} is empty")
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                f"leader election: need 0 < retry period ({self.retry_period:g}s) < renew "
                f"deadline ({self.renew_deadline:g}s) < lease duration ({self.lease_duration:g}s)"
            )


class Elector:
    """Campaigns for one Lease; `step` is one attempt to acquire or renew it (the tests drive it
    with a fake clock), `run` repeats it every retry period until `stop`."""

    def __init__(
        self,
        api: LeaseApi,
        election: Election,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        changed: Callable[[bool], None] = lambda leading: None,
    ) -> None:
        self.api, self.election = api, election
        self.clock, self.wall, self.changed = clock, wall, changed
        self.path = f"{API}/namespaces/{election.namespace}/leases/{election.name}"
        self._seen: tuple[Any, ...] | None = None  # the record last read, and when it changed
        self._seen_at = 0.0
        self._renewed: float | None = None  # when this replica last wrote the Lease as holder
        self._leading = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def leading(self) -> bool:
        """Whether this replica holds the Lease and renewed it within the renew deadline."""
        renewed = self._renewed
        return renewed is not None and self.clock() - renewed < self.election.renew_deadline

    def step(self) -> bool:
        """One attempt to acquire or renew the Lease; whether this replica leads afterwards."""
        try:
            self._try()
        except (ApiError, OSError) as err:  # the API server unreachable or refusing: retry
            log.warning("lease %s: %s", self.election.name, err)
        leading = self.leading()
        if leading != self._leading:
            self._leading = leading
            if leading:
                log.info("lease %s/%s: %s leads", self.election.namespace, self.election.name,
                         self.election.identity)  # fmt: skip
            else:
                log.warning("lease %s/%s: %s stepped down", self.election.namespace,
                            self.election.name, self.election.identity)  # fmt: skip
            self.changed(leading)
        return leading

    def _try(self) -> None:
        now = self.clock()
        # As long as the renew deadline: an API server slow to answer on a loaded node is not a
        # failed attempt. Times are taken before the request, so a late answer never extends a
        # lease.
        timeout = self.election.renew_deadline
        try:
            lease = self.api.request("GET", self.path, timeout=timeout)
        except ApiError as err:
            if err.status != 404:
                raise
            lease = None
        if lease is None:
            body = {"metadata": {"name": self.election.name}, "spec": self._claim({}, now)}
            collection = self.path.rsplit("/", 1)[0]
            if self._write("POST", collection, body, timeout):
                self._renewed = now
            return
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("acquireTime"),
                  spec.get("leaseDurationSeconds"), spec.get("leaseTransitions"))  # fmt: skip
        if record != self._seen:
            self._seen, self._seen_at = record, now
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.election.lease_duration)
        if holder != self.election.identity:
            self._renewed = None  # someone else holds it (or held it): not ours
            if holder and now - self._seen_at < duration:
                return  # held, and not expired by our clock
        body = {"metadata": lease["metadata"], "spec": self._claim(spec, now)}
        if self._write("PUT", self.path, body, timeout):
            self._renewed = now

    def _claim(self, spec: dict[str, Any], now: float) -> dict[str, Any]:
        """The Lease's spec with this replica holding it, renewed now."""
        stamp = _micro_time(self.wall())
        ours = spec.get("holderIdentity") == self.election.identity
        transitions = int(spec.get("leaseTransitions") or 0)
        return {
            "holderIdentity": self.election.identity,
            "leaseDurationSeconds": round(self.election.lease_duration),
            "acquireTime": spec.get("acquireTime", stamp) if ours else stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions if ours or not spec else transitions + 1,
        }

    def _write(self, method: str, path: str, body: dict[str, Any], timeout: float) -> bool:
        """Create or replace the Lease; False when another replica wrote first (409)."""
        try:
            written = self.api.request(method, path, body, timeout=timeout)
        except ApiError as err:
            if err.status != 409:
                raise
            log.debug("lease %s: another replica wrote first", self.election.name)
            return False
        spec = (written or body).get("spec") or {}
        self._seen = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("acquireTime"),
                      spec.get("leaseDurationSeconds"), spec.get("leaseTransitions"))  # fmt: skip
        self._seen_at = self.clock()
        return True

    def release(self) -> None:
        """Give the Lease up at once (on a clean shutdown), so a standby need not wait for it to
        expire: the holder emptied, as client-go's ReleaseOnCancel does."""
        if not self.leading():
            return
        self._renewed = None
        try:
            lease = self.api.request("GET", self.path, timeout=self.election.retry_period)
            if (lease.get("spec") or {}).get("holderIdentity") != self.election.identity:
                return
            stamp = _micro_time(self.wall())
            spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1,
                    "renewTime": stamp, "acquireTime": stamp}  # fmt: skip
            body = {"metadata": lease["metadata"], "spec": spec}
            self.api.request("PUT", self.path, body, timeout=self.election.retry_period)
            log.info("lease %s: released by %s", self.election.name, self.election.identity)
        except (ApiError, OSError) as err:  # it expires on its own
            log.warning("lease %s: not released: %s", self.election.name, err)
        finally:
            if self._leading:
                self._leading = False
                self.changed(False)

    def start(self) -> None:
        """Campaign in a background thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # never the end of the campaign: a replica that stopped it would
                # stand by for good, or lead no more without stepping down
                log.exception("lease %s: an attempt failed", self.election.name)
            self._stop.wait(self.election.retry_period)

    def stop(self) -> None:
        """Stop campaigning and release the Lease if held."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.election.retry_period)
        self.release()


def _micro_time(moment: datetime) -> str:
    """A metav1.MicroTime: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
