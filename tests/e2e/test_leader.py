"""Leader election end to end on the local cluster: the chart's two operator replicas (two local
processes) on one `tiny` job of 1-2 CPU worker pods. The one holding the Lease reconciles, the
other reconciles nothing; the leader killed without notice, the standby takes the Lease over once
it expires and answers a `kubectl scale`; with the operator uninstalled, the job still deletes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until
from tests.e2e.deployment import CHART, install_crd, release_name
from tests.e2e.test_operator import (
    JOB,
    OPERATOR_METRICS_PORT,
    STARTUP,
    Steps,
    job,
    metrics,
    training,
)

LEASE_DURATION, RETRY_PERIOD = 15, 2  # the chart's defaults
PASSES = ("liveshard_operator_reconcile_seconds_count", "")


@pytest.fixture
def operators(kube: Kube, tmp_path: Path) -> Iterator[tuple[Kube, str]]:
    """The chart with its defaults (two replicas, leader election) watching the test's namespace;
    the release's name."""
    install_crd(kube)
    release = release_name()
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"watchNamespaces": [kube.namespace]}))
    kube.run("helm", "install", release, str(CHART), "-n", kube.namespace, "-f", str(values),
             "--wait", "--timeout=120s", timeout=150)  # fmt: skip
    yield kube, release
    kube.kubectl("delete", "etj", "--all", "--wait=false", check=False)
    kube.run("helm", "uninstall", release, "-n", kube.namespace, "--wait", check=False)


def test_the_standby_takes_the_lease_over_and_the_job_outlives_the_operator(
    operators: tuple[Kube, str],
) -> None:
    kube, release = operators
    lease_path = (f"/apis/coordination.k8s.io/v1/namespaces/{kube.namespace}/leases/"
                  f"{release}-liveshard-operator")  # fmt: skip

    def lease() -> dict[str, Any]:
        found = kube.get(lease_path)
        assert found is not None, "no Lease"
        return dict(found["spec"])

    def operator_pods() -> dict[str, dict[str, Any]]:
        pods = kube.pods(f"app.kubernetes.io/instance={release}")
        return {
            p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")
        }

    kube.apply(job(1))
    steps = Steps(kube)
    first = steps.wait(training(1), "training with 1", STARTUP)
    held = lease()
    leader = held["holderIdentity"].split("_")[0]
    pods = operator_pods()
    assert len(pods) == 2 and leader in pods, (held, list(pods))
    (standby,) = set(pods) - {leader}
    assert metrics(pods[leader], OPERATOR_METRICS_PORT).get(PASSES, 0) > 0
    assert metrics(pods[standby], OPERATOR_METRICS_PORT).get(PASSES, 0) == 0  # watches only

    # The leader dies without notice: it cannot hand the Lease over.
    kube.kubectl("delete", "pod", leader, "--grace-period=0", "--force")
    killed = time.monotonic()

    def state() -> str:  # what a takeover that does not come shows
        phases = {name: (p.get("status") or {}).get("phase") for name, p in operator_pods().items()}
        return f"the Lease {lease()}; the operator's pods {phases}"

    taken = wait_until(lambda: (s := lease())["holderIdentity"].startswith(f"{standby}_") and s,
                       LEASE_DURATION + 30, "the standby holding the Lease",
                       describe=state)  # fmt: skip
    # Expired by the standby's clock: a lease duration after it last saw a renewal, which came
    # at most a retry period before the kill, and found at its next try (a few seconds of slack
    # for two shared cores).
    took = time.monotonic() - killed
    assert took <= LEASE_DURATION + 2 * RETRY_PERIOD + 5, f"took the Lease after {took:.1f}s"
    assert taken["leaseTransitions"] == held["leaseTransitions"] + 1

    # The new leader reconciles the job: a scale after the takeover is answered.
    kube.kubectl("scale", f"etj/{JOB}", "--replicas=2")
    steps.wait(training(2, first["epoch"] + 1), "grown to 2 under the new leader", STARTUP)
    assert metrics(operator_pods()[standby], OPERATOR_METRICS_PORT)[PASSES] > 0

    # The operator gone, the job is deleted all the same: no finalizer waits for it.
    kube.run("helm", "uninstall", release, "-n", kube.namespace, "--wait", "--timeout=60s")
    kube.kubectl("delete", "etj", JOB, "--timeout=30s")
    workers = f"liveshard.io/job={JOB}"
    wait_until(lambda: all(p["metadata"].get("deletionTimestamp") for p in kube.pods(workers)),
               60, "the workers deleted with their job")  # fmt: skip
