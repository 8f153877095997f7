"""Gang scheduling with a real coscheduling scheduler: scheduler-plugins' scheduler, built from its
Go module like the control plane, runs beside the cluster's own as a second scheduler; the job's
workers name it (`template.spec.schedulerName`) and carry the PodGroup's label
(`scheduling.gang`). A gang that cannot be placed whole is not placed at all, and is placed whole
once capacity for it returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from liveshard_e2e import procs
from liveshard_e2e.binaries import find_binaries
from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until
from tests.e2e.deployment import install_crd
from tests.e2e.test_operator import (  # noqa: F401
    STARTUP,
    Steps,
    job,
    members,
    operator,
    status,
    training,
)

SCHEDULER = "liveshard-coscheduling"


@pytest.fixture
def coscheduling(operator: Kube, tmp_path: Path) -> Iterator[Kube]:  # noqa: F811
    """scheduler-plugins' PodGroup CRD applied and its scheduler running as `SCHEDULER`, with
    the coscheduling plugin."""
    kube = operator
    bins = find_binaries()
    install_crd(kube, bins.pod_group_crd, ("podgroups.scheduling.x-k8s.io",))
    config = tmp_path / "scheduler.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kube.info.kubeconfig)},
        "profiles": [{
            "schedulerName": SCHEDULER,
            "plugins": {
                "multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                "queueSort": {"enabled": [{"name": "Coscheduling"}], "disabled": [{"name": "*"}]},
            },
            "pluginConfig": [{"name": "Coscheduling", "args": {"permitWaitingTimeSeconds": 10}}],
        }],
    }))  # fmt: skip
    log = tmp_path / "scheduler.log"
    argv = [str(bins.kube_scheduler_plugins), f"--config={config}", "--secure-port=0", "--v=1"]
    proc, record = procs.start("the coscheduling scheduler", argv, log)
    try:
        yield kube
    finally:
        procs.stop(record)
        proc.wait(timeout=30)


def test_a_gang_that_does_not_fit_whole_is_not_placed_until_it_does(coscheduling: Kube) -> None:
    kube = coscheduling
    nodes = sorted(n["metadata"]["name"] for n in kube.get("/api/v1/nodes")["items"])  # type: ignore[index]
    # A worker asks for 5 of a node's 8 CPUs: one fits a node. With one node open, one of the
    # two workers the job needs at least could run; its gang holds it back.
    body = job(2, minReplicas=2, scheduling={"gang": True, "pendingTimeoutSeconds": 30})
    spec = body["spec"]["template"]["spec"]
    spec["schedulerName"] = SCHEDULER
    spec["containers"][0]["resources"]["requests"]["cpu"] = "5"
    closed = nodes[1:]
    kube.run("kubectl", "cordon", *closed)
    try:
        kube.apply(body)
        wait_until(lambda: len(members(kube)) == 2, 60, "the job's 2 workers")
        # Longer than the plugin's permit wait (10 s): a worker placed alone would be bound
        # by now, as the cluster's own scheduler binds it at once (test_operator.py).
        since = time.monotonic()
        while time.monotonic() - since < 25:
            placed = [n for n, p in members(kube).items() if p["spec"].get("nodeName")]
            assert not placed, f"{placed} placed while its gang cannot be"
            time.sleep(1)
        pods = members(kube)
        for name, pod in pods.items():
            scheduled = next(c for c in pod["status"].get("conditions", [])
                             if c["type"] == "PodScheduled")  # fmt: skip
            assert scheduled["status"] == "False", (name, scheduled)
        pending = status(kube)
        assert pending.get("phase") == "Pending" and not pending.get("members"), pending

        kube.run("kubectl", "uncordon", closed[0])
        steps = Steps(kube)
        started = steps.wait(lambda s: training(2)(s) and s.get("step", 0) >= 2,
                             "the gang placed whole, training", STARTUP)  # fmt: skip
        placed_on = {members(kube)[m]["spec"]["nodeName"] for m in started["members"]}
        assert placed_on == {nodes[0], closed[0]}, placed_on
        assert {p["spec"]["schedulerName"] for p in members(kube).values()} == {SCHEDULER}
    finally:
        kube.run("kubectl", "uncordon", *closed, check=False)
