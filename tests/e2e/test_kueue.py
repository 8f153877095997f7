"""Kueue, built from its Go module like the control plane, queueing a job's workers through its
`pod` integration, as docs/install.md tells users to set it up: the workers carry the
LocalQueue's label, Kueue gates each until the ClusterQueue's quota admits it, the job trains with
the pods admitted and grows live when the quota grows.

Kueue runs as a local process (no Service network here): its pod webhook is registered with its
URL and a serving certificate of a CA the test makes, limited to the test's namespace and to pods
that carry a queue label, so that nothing else in the shared cluster goes through it.
"""

from __future__ import annotations

import base64
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from liveshard_e2e import procs
from liveshard_e2e.binaries import find_binaries
from liveshard_e2e.pki import create_pki, issue_serving_cert
from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until
from tests.e2e.deployment import install_crd
from tests.e2e.test_operator import (  # noqa: F401
    GLOBAL_BATCH,
    STARTUP,
    Steps,
    agent_status,
    condition,
    job,
    members,
    operator,
    short_of,
    token,
    training,
)

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GATE = "kueue.x-k8s.io/admission"
KUEUE_API = "kueue.x-k8s.io/v1beta2"


@pytest.fixture
def kueue(operator: Kube, tmp_path: Path) -> Iterator[Kube]:  # noqa: F811
    """Kueue's CRDs applied, its manager running with only the `pod` integration for the pods of
    the test's namespace that name a queue, and the LocalQueue `team` of a ClusterQueue with room
    for 3 workers. Afterwards the job, its pods and the queues are deleted while Kueue still
    runs: it holds finalizers on each."""
    kube = operator
    bins = find_binaries()
    install_crd(kube, bins.kueue_crds, tuple(f"{kind}.kueue.x-k8s.io" for kind in (
        "workloads", "clusterqueues", "localqueues", "resourceflavors")))  # fmt: skip
    pki = create_pki(tmp_path / "kueue-pki")
    pair = issue_serving_cert(pki, tmp_path / "kueue-pki", "kueue-webhook", ["127.0.0.1"])
    certs = tmp_path / "kueue-certs"
    certs.mkdir()
    shutil.copy(pair.cert, certs / "tls.crt")
    shutil.copy(pair.key, certs / "tls.key")
    port, health = procs.free_port(), procs.free_port()
    config = tmp_path / "kueue.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": "kueue-system",  # its own, which the selector below must not match
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["pod"]},
        "managedJobsNamespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": kube.namespace},
        },
    }))  # fmt: skip
    log = tmp_path / "kueue.log"
    env = {**kube.env(), "KUBECONFIG": str(kube.info.kubeconfig)}
    proc, record = procs.start("kueue", ["unshare", "--mount", "--map-root-user", "sh", "-c",
                                         _LAUNCH, "kueue", str(bins.kueue), str(config),
                                         str(certs)], log, env=env)  # fmt: skip
    webhook = f"liveshard-kueue-{kube.namespace}"
    try:
        wait_until(lambda: proc.poll() is not None or _listening(port), 120,
                   "Kueue's webhook server", describe=lambda: procs.tail(log))  # fmt: skip
        assert proc.poll() is None, f"kueue exited: {procs.tail(log)}"
        selector = {"matchLabels": {"kubernetes.io/metadata.name": kube.namespace}}
        kube.apply({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": webhook},
            "webhooks": [{
                "name": "mpod.kb.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": "Fail", "namespaceSelector": selector,
                "objectSelector": {"matchExpressions": [
                    {"key": QUEUE_LABEL, "operator": "Exists"}]},
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/mutate--v1-pod",
                    "caBundle": base64.b64encode(pki.ca.cert.read_bytes()).decode(),
                },
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"],
                           "operations": ["CREATE"], "resources": ["pods"]}],
            }],
        })  # fmt: skip
        kube.apply({"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
                    "metadata": {"name": _flavor(kube)}})  # fmt: skip
        kube.apply(_quota(kube, 3))
        kube.apply({"apiVersion": KUEUE_API, "kind": "LocalQueue",
                    "metadata": {"name": "team", "namespace": kube.namespace},
                    "spec": {"clusterQueue": _cluster_queue(kube)}})  # fmt: skip
        yield kube
    finally:
        kube.kubectl("delete", "etj", "--all", "--wait=false", check=False)
        wait_until(lambda: not kube.pods("liveshard.io/job=tiny") and not _workloads(kube),
                   120, "the job's pods and workloads gone")  # fmt: skip
        kube.kubectl("delete", "localqueue", "team", "--timeout=60s", check=False)
        kube.kubectl("delete", "clusterqueue", _cluster_queue(kube), "--timeout=60s", check=False)
        kube.kubectl("delete", "resourceflavor", _flavor(kube), "--timeout=60s", check=False)
        kube.kubectl("delete", "mutatingwebhookconfiguration", webhook, check=False)
        procs.stop(record)
        proc.wait(timeout=30)


# Kueue reads its metrics server's pair from a fixed path when it does not issue its own
# certificates: in a mount namespace of its own, /etc is a tmpfs holding that pair and the files
# name resolution reads, so nothing of the machine's /etc changes.
_LAUNCH = """set -e
mkdir -p "$3/etc"
for f in hosts resolv.conf nsswitch.conf; do [ ! -e /etc/$f ] || cp /etc/$f "$3/etc/"; done
mount -t tmpfs kueue /etc
cp -r "$3/etc/." /etc/
mkdir -p /etc/kueue/metrics/certs
cp "$3/tls.crt" "$3/tls.key" /etc/kueue/metrics/certs/
exec "$1" --config="$2" --feature-gates=VisibilityOnDemand=false
"""


def _workloads(kube: Kube) -> list[dict[str, Any]]:
    found = kube.get(f"/apis/{KUEUE_API}/namespaces/{kube.namespace}/workloads")
    return list((found or {}).get("items") or [])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _cluster_queue(kube: Kube) -> str:
    return f"cq-{kube.namespace}"


def _flavor(kube: Kube) -> str:
    return f"flavor-{kube.namespace}"


def _quota(kube: Kube, pods: int) -> dict[str, Any]:
    """The ClusterQueue with room for `pods` workers (each asks 100m CPU and 256Mi), where a
    workload of a higher priority preempts lower ones."""
    return {
        "apiVersion": KUEUE_API, "kind": "ClusterQueue",
        "metadata": {"name": _cluster_queue(kube)},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{
                "coveredResources": ["cpu", "memory"],
                "flavors": [{"name": _flavor(kube), "resources": [
                    {"name": "cpu", "nominalQuota": f"{100 * pods}m"},
                    {"name": "memory", "nominalQuota": f"{256 * pods}Mi"},
                ]}],
            }],
        },
    }  # fmt: skip


def test_kueue_admits_the_workers_it_has_quota_for_grows_the_job_and_preempts_one_live(
    kueue: Kube,
) -> None:
    """Quota for 3 of 4 workers: the job trains with 3, grows to 4 once the quota does, then
    loses one to a preemption and takes it back (`_preempted_and_taken_back`)."""
    kube = kueue
    body = job(4, minReplicas=2)
    body["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {})[QUEUE_LABEL] = (
        "team"
    )
    kube.apply(body)
    steps = Steps(kube)
    first = steps.wait(short_of(3), "training with the 3 pods Kueue admitted", STARTUP)
    degraded = condition(first, "Degraded")
    # A gated pod is one the scheduler may not place yet: the job goes on without it at once.
    assert degraded["reason"] == "SchedulingGated", degraded
    assert degraded["message"].startswith("1 of 4 pods missing"), degraded
    # Every worker went through Kueue: admitted ones lost their gate, the fourth still has it.
    pods = kube.pods("liveshard.io/job=tiny")
    gated = [p for p in pods if GATE in {g["name"] for g in p["spec"].get("schedulingGates", [])}]
    assert len(pods) == 4 and len(gated) == 1, [p["metadata"]["name"] for p in gated]
    workloads = _workloads(kube)
    admitted = [w for w in workloads if (w.get("status") or {}).get("admission")]
    assert len(workloads) == 4 and len(admitted) == 3, [w["metadata"] for w in workloads]

    kube.apply(_quota(kube, 4))
    grown = steps.wait(training(4, first["epoch"] + 1), "grown to 4 once admitted", STARTUP)
    assert set(first["members"]) < set(grown["members"])
    assert grown["lastReconfiguration"]["to"].startswith("dp=4")
    steps.wait(lambda s: s.get("step", 0) > grown["step"], "training on with 4")
    wait_until(lambda: not any(p["spec"].get("schedulingGates")
                               for p in kube.pods("liveshard.io/job=tiny")),
               30, "no worker gated")  # fmt: skip
    _preempted_and_taken_back(kube, steps, grown)


def _preempted_and_taken_back(kube: Kube, steps: Steps, first: dict[str, Any]) -> None:
    """A pod of a higher priority comes to the full queue: Kueue evicts one of the job's
    `replicas` workers (deletes its pod). The job drains that member live and trains on without
    it, its replacement waits gated; once the preemptor is gone, Kueue admits it and the job
    grows back."""
    replicas = first["replicas"]
    high = f"high-{kube.namespace}"
    kube.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": high}, "value": 1000})  # fmt: skip
    preemptor = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "preemptor", "namespace": kube.namespace,
                     "labels": {QUEUE_LABEL: "team"}},
        "spec": {"priorityClassName": high, "restartPolicy": "Never", "containers": [{
            "name": "main", "image": "sleep", "command": ["sleep", "3600"],
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        }]},
    }  # fmt: skip
    try:
        kube.apply(preemptor)
        shrunk = steps.wait(
            lambda s: short_of(replicas - 1)(s) and s.get("epoch", 0) > first["epoch"],
            "training with one worker less once Kueue preempted one",
        )  # fmt: skip
        last = shrunk["lastReconfiguration"]
        assert last["result"] == "committed", last  # a drain, not a recovery from a loss
        assert set(shrunk["members"]) < set(first["members"])
        assert condition(shrunk, "Degraded")["reason"] == "SchedulingGated", shrunk
        wait_until(lambda: (kube.get(f"/api/v1/namespaces/{kube.namespace}/pods/preemptor")
                            or {}).get("status", {}).get("phase") == "Running",
                   60, "the preemptor running")  # fmt: skip
        steps.wait(lambda s: s.get("step", 0) > shrunk["step"], "training on without it")
        kube.kubectl("delete", "pod", "preemptor", "--grace-period=0", "--force")
        grown = steps.wait(training(replicas, shrunk["epoch"] + 1), "grown back", STARTUP)
        assert grown["lastReconfiguration"]["result"] == "committed"
        # The data cursor of every member is where its step says: no sample lost or repeated.
        pods, secret = members(kube), token(kube)
        for name in grown["members"]:
            agent = agent_status(kube, pods[name], secret)
            assert agent.samples == agent.step * GLOBAL_BATCH, (name, agent.samples, agent.step)
    finally:
        kube.kubectl("delete", "pod", "preemptor", "--grace-period=0", "--force", check=False)
        kube.kubectl("delete", "priorityclass", high, check=False)
