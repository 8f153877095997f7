"""The operator end to end on the local cluster: the chart installed with helm, the example job
applied with kubectl, resized with `kubectl scale`, a node drained, the operator killed.

Each test installs the chart (one operator pod, holding its Lease) in its own namespace and runs a
`tiny` job of 2-5 worker pods, each a local process that imports torch and trains on CPU.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from liveshard_operator import pki
from prometheus_client.parser import text_string_to_metric_families

from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_core.job import DEFAULT_METRICS_PORT
from liveshard_core.layout.layout import parse_degrees
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.presets import CONFIGS
from liveshard_e2e.binaries import find_binaries
from liveshard_e2e.testing import Kube, member_pid
from liveshard_e2e.waiting import wait_until
from tests.e2e.cert_manager import API as CERT_MANAGER_API
from tests.e2e.cert_manager import CertManager
from tests.e2e.deployment import API, CHART, example, install_crd, release_name

JOB = "tiny"
ROOT = Path(__file__).resolve().parents[2]
VOLCANO_PODGROUP_CRD = Path(__file__).with_name("volcano-podgroup-crd.yaml")
CERT_MANAGER_CRDS = Path(__file__).with_name("cert-manager-crds.yaml")
OPERATOR_METRICS_PORT = 9401  # the chart's metrics.port
GLOBAL_BATCH = 24
STARTUP = 240  # seconds: pods start one torch import each, on 2 cores


@contextlib.contextmanager
def installed(kube: Kube, tmp_path: Path, **values: Any) -> Iterator[Kube]:
    """The chart installed in the test's namespace with `values`, its operator watching that
    namespace."""
    install_crd(kube)
    release = release_name()
    path = tmp_path / "values.yaml"
    # One replica (leader election on, as by default): the tests read its log and metrics.
    path.write_text(yaml.safe_dump({"watchNamespaces": [kube.namespace],
                                    "operator": {"replicas": 1}, **values}))  # fmt: skip
    kube.run("helm", "install", release, str(CHART), "-n", kube.namespace, "-f", str(path),
             "--wait", "--timeout=120s", timeout=150)  # fmt: skip
    try:
        yield kube
    finally:
        kube.kubectl("delete", "etj", "--all", "--wait=false", check=False)
        kube.run("helm", "uninstall", release, "-n", kube.namespace, "--wait", check=False)


@pytest.fixture
def operator(kube: Kube, tmp_path: Path) -> Iterator[Kube]:
    """The chart installed as by default."""
    with installed(kube, tmp_path) as kube:
        yield kube


def job(replicas: int, **spec: Any) -> dict[str, Any]:
    body = example("tiny-job")
    body["spec"]["replicas"] = replicas
    # Short deadlines: a test that goes wrong fails in seconds, not minutes.
    body["spec"]["reconfiguration"] = {
        "opTimeoutSeconds": 10, "switchDeadlineSeconds": 30, "prepareDeadlineSeconds": 60,
    }  # fmt: skip
    body["spec"].update(spec)
    return body


def status(kube: Kube) -> dict[str, Any]:
    obj = kube.get(f"{API}/namespaces/{kube.namespace}/elastictrainingjobs/{JOB}")
    assert obj is not None
    return dict(obj.get("status") or {})


class Steps:
    """Watches the job's status; asserts that its step never goes back."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.seen: list[int] = []
        self.backwards: list[tuple[int, int]] = []  # (before, after) whenever the step went back

    def wait(
        self, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120
    ) -> dict[str, Any]:
        def look() -> dict[str, Any] | None:
            current = status(self.kube)
            if "step" in current:
                if self.seen and current["step"] < self.seen[-1]:
                    self.backwards.append((self.seen[-1], current["step"]))
                self.seen.append(current["step"])
            return current if check(current) else None

        found = wait_until(look, timeout, f"job {JOB}: {what}",
                           describe=lambda: json.dumps(status(self.kube))[:2000])  # fmt: skip
        assert not self.backwards, f"the job's step went back: {self.backwards}"
        return found


def condition(s: dict[str, Any], kind: str) -> dict[str, Any]:
    """The job status `s`'s condition of type `kind` ({} while it has none)."""
    return next((c for c in s.get("conditions", []) if c["type"] == kind), {})


def short_of(replicas: int) -> Callable[[dict[str, Any]], bool]:
    """Training with `replicas` members past step 2, the Degraded condition saying pods are
    missing."""

    def check(s: dict[str, Any]) -> bool:
        degraded = condition(s, "Degraded")
        return training(replicas)(s) and s.get("step", 0) >= 2 and degraded.get("status") == "True"

    return check


def training(replicas: int, epoch: int | None = None) -> Callable[[dict[str, Any]], bool]:
    def check(s: dict[str, Any]) -> bool:
        return (s.get("phase") == "Running" and s.get("replicas") == replicas
                and s.get("readyReplicas") == replicas
                and (epoch is None or s.get("epoch", -1) >= epoch))  # fmt: skip

    return check


def started(kube: Kube, replicas: int, **spec: Any) -> tuple[Steps, dict[str, Any]]:
    """Apply the job; its status once it trains with `replicas` members past step 2."""
    kube.apply(job(replicas, **spec))
    steps = Steps(kube)

    def past_step_2(s: dict[str, Any]) -> bool:
        return training(replicas)(s) and s.get("step", 0) >= 2

    return steps, steps.wait(past_step_2, f"training with {replicas}", STARTUP)


def members(kube: Kube) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in kube.pods(f"liveshard.io/job={JOB}")}


def agent_status(
    kube: Kube,
    pod: dict[str, Any],
    token: str | None,
    *,
    tls: bool = True,
    operator: dict[str, bytes] | None = None,
    member: str = "",
) -> pb.AgentStatus:
    """GetStatus of a worker's agent (of `member`, in a pod of several), presenting the
    operator's client certificate (`tls`) as the operator does (from its Secret, or `operator`:
    its data as it was), or in plaintext."""
    address = f"{pod['status']['podIP']}:7070"
    if tls:
        operator = operator or secret_data(kube, f"{JOB}-operator-tls")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=operator["ca.crt"], private_key=operator["tls.key"],
            certificate_chain=operator["tls.crt"],
        )  # fmt: skip
        name = f"agent.{JOB}.{kube.namespace}.liveshard"
        channel = grpc.secure_channel(
            address, credentials, [("grpc.ssl_target_name_override", name)]
        )
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        metadata += (("liveshard-member", member),) if member else ()
        return pb_grpc.AgentStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10,
                                                    metadata=metadata)  # fmt: skip


def metrics(pod: dict[str, Any], port: int = DEFAULT_METRICS_PORT) -> dict[tuple[str, str], float]:
    """A pod's Prometheus metrics (a worker's by default): (series, its phase or result label)
    -> value."""
    url = f"http://{pod['status']['podIP']}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = sample.labels.get("phase") or sample.labels.get("result") or ""
            out[(sample.name, label)] = sample.value
    return out


def selector(label_selector: dict[str, Any]) -> str:
    """A LabelSelector of matchLabels as a query's `labelSelector`."""
    return ",".join(f"{k}={v}" for k, v in sorted(label_selector["matchLabels"].items()))


def pod_port(pod: dict[str, Any], name: str) -> int:
    """The number of the agent container's port `name`."""
    ports = pod["spec"]["containers"][0]["ports"]
    return int(next(p["containerPort"] for p in ports if p["name"] == name))


def event_reasons(kube: Kube) -> list[str]:
    events = kube.kubectl("get", "events", "--field-selector", f"involvedObject.name={JOB}",
                          "-o", "json").stdout  # fmt: skip
    return [e["reason"] for e in json.loads(events)["items"]]


def secret_data(kube: Kube, name: str) -> dict[str, bytes]:
    found = kube.get(f"/api/v1/namespaces/{kube.namespace}/secrets/{name}")
    assert found is not None
    return {key: base64.b64decode(value) for key, value in found["data"].items()}


def token(kube: Kube) -> str:
    return secret_data(kube, f"{JOB}-token")["token"].decode()


def test_scale_down_and_up_live(operator: Kube, tmp_path: Path) -> None:
    kube = operator
    kube.apply(job(4))
    steps = Steps(kube)
    first = steps.wait(
        lambda s: training(4)(s) and s.get("step", 0) >= 3, "training with 4", STARTUP
    )
    assert first["selector"] == f"liveshard.io/job={JOB},liveshard.io/role=member"
    before = members(kube)

    kube.kubectl("scale", f"etj/{JOB}", "--replicas=2")
    shrunk = steps.wait(training(2, first["epoch"] + 1), "shrunk to 2")
    last = shrunk["lastReconfiguration"]
    assert last["result"] == "committed" and last["to"].startswith("dp=2")
    assert last["pauseSeconds"] > 0 and last["bytesMoved"] >= 0
    survivors = set(shrunk["members"])
    after = members(kube)
    for name in survivors:  # the same pods trained on: same UID, never restarted
        assert after[name]["metadata"]["uid"] == before[name]["metadata"]["uid"]
        assert after[name]["status"]["containerStatuses"][0]["restartCount"] == 0
    wait_until(lambda: set(members(kube)) == survivors, 60, "the leaving pods deleted")

    kube.kubectl("scale", f"etj/{JOB}", "--replicas=3")
    grown = steps.wait(training(3, shrunk["epoch"] + 1), "grown to 3", STARTUP)
    assert survivors < set(grown["members"])
    assert grown["lastReconfiguration"]["to"].startswith("dp=3")
    steps.wait(lambda s: s.get("step", 0) > grown["step"], "training on in the new layout")
    # The data cursor of every member is where the step says: no sample lost or repeated.
    secret = token(kube)
    pods = members(kube)
    for name in grown["members"]:
        agent = agent_status(kube, pods[name], secret)
        assert agent.epoch == grown["epoch"]
        assert agent.samples == agent.step * GLOBAL_BATCH, (name, agent.samples, agent.step)
    assert event_reasons(kube).count("Reconfigured") >= 3  # the first world, 4 -> 2, 2 -> 3
    # Every member's metrics: its step moves, it trains, and the survivors counted the switches.
    for name in grown["members"]:
        first_scrape = metrics(pods[name])
        assert first_scrape[("liveshard_member_phase", "training")] == 1
        assert first_scrape[("liveshard_tokens_per_second", "")] > 0
        wait_until(lambda n=name, f=first_scrape: metrics(pods[n])[("liveshard_step", "")]
                   > f[("liveshard_step", "")], 60, f"{name}'s step metric rising")  # fmt: skip
        switched = first_scrape[("liveshard_reconfigurations_total", "committed")]
        assert switched >= (2 if name in survivors else 1), (name, switched)
    # The operator's: its passes timed, the job's members by phase.
    (operator_pod,) = kube.pods("app.kubernetes.io/name=liveshard")
    seen = metrics(operator_pod, OPERATOR_METRICS_PORT)
    assert seen[("liveshard_operator_reconcile_seconds_count", "")] > 0
    assert seen[("liveshard_operator_members", "training")] == 3
    # The job's story from its status (progress and history), drawn through kubectl.
    png = tmp_path / "timeline.png"
    drawn = subprocess.run(
        [str(Path(sys.executable).parent / "liveshard"), "timeline", "--job", JOB, "-n",
         kube.namespace, "--kubectl", str(kube.info.kubectl), "--out", str(png), "--json"],
        capture_output=True, text=True, env=kube.env(), timeout=120, check=False,
    )  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr
    summary = json.loads(drawn.stdout)
    assert summary["layouts"] >= 3 and summary["reconfigurations"] >= 3, summary  # 4, 2, 3
    assert summary["steps"] >= 3 and png.stat().st_size > 10_000


def test_members_that_cannot_read_a_decision_are_told_it_and_the_job_never_splits(
    operator: Kube,
) -> None:
    # Every worker loses the change's store just before it reads the first switch's decision
    # (injected at the agent's start): all are undecided, none read a commit, so the operator
    # tells them to abort, and the retry grows the job.
    kube = operator
    body = job(2)
    inject = ROOT / "tests" / "agent" / "server" / "inject"
    (container,) = body["spec"]["template"]["spec"]["containers"]
    container["env"] = [
        {"name": "PYTHONPATH", "value": f"{inject}{os.pathsep}{ROOT}"},
        {"name": "TEST_LOSE_THE_DECISION", "value": "*"},
    ]
    kube.apply(body)
    steps = Steps(kube)
    first = steps.wait(training(2), "training with 2", STARTUP)
    kube.kubectl("scale", f"etj/{JOB}", "--replicas=3")
    grown = steps.wait(training(3, first["epoch"] + 2), "grown to 3 on a retry", STARTUP)
    told, committed = grown["history"][-2:]
    assert (told["result"], told["epoch"]) == ("aborted", first["epoch"] + 1), told
    assert "no member read the decision" in told["message"], told
    assert committed["result"] == "committed" and committed["to"].startswith("dp=3"), committed
    assert condition(grown, "Failed").get("status") != "True", grown
    reasons = event_reasons(kube)
    assert "ReconfigurationAborted" in reasons and "SplitReconfiguration" not in reasons
    steps.wait(lambda s: s.get("step", 0) > grown["step"], "training on in the new layout")


def test_drain_moves_a_worker_out_before_it_is_killed(operator: Kube) -> None:
    kube = operator
    body = job(3)
    # A grace period longer than the drain may take: only a release lets the pod go in time.
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 900
    kube.apply(body)
    steps = Steps(kube)
    start = steps.wait(
        lambda s: training(3)(s) and s.get("step", 0) >= 2, "training with 3", STARTUP
    )
    pods = members(kube)
    victim = pods[start["members"][-1]]
    node = victim["spec"]["nodeName"]
    on_node = {n for n, p in pods.items() if p["spec"]["nodeName"] == node}
    try:
        drain = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s"]
        kube.run("kubectl", *drain, "--pod-selector", f"liveshard.io/job={JOB}", timeout=300)

        # The drain returned: the node's workers are gone, and the job trains without them.
        def without_them(s: dict[str, Any]) -> bool:
            gone = not on_node & set(s.get("members", []))
            return s.get("phase") == "Running" and gone and s.get("epoch", 0) > start["epoch"]

        drained = steps.wait(without_them, "running without the node")
        last = drained["lastReconfiguration"]
        assert last["result"] == "committed", last
    finally:
        kube.run("kubectl", "uncordon", node, check=False)
    # A replacement pod pre-warms and joins: the job is back to 3 members.
    steps.wait(training(3), "back to 3 members", STARTUP)


def test_a_deleted_jobs_workers_end_at_once_not_at_their_grace_period(operator: Kube) -> None:
    kube = operator
    body = job(2)
    # Were they left to it, the workers would train on through SIGTERM for 900 s.
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 900
    kube.apply(body)
    Steps(kube).wait(lambda s: training(2)(s) and s.get("step", 0) >= 2, "training", STARTUP)
    assert len(members(kube)) == 2
    kube.kubectl("delete", "etj", JOB, "--wait=false")
    wait_until(lambda: not members(kube) or None, 120, "the deleted job's pods gone",
               describe=lambda: str(sorted(members(kube))))  # fmt: skip
    (operator_pod,) = kube.pods("app.kubernetes.io/name=liveshard")
    assert "is gone: 2 agents discarded" in kube.logs(operator_pod["metadata"]["name"])


def test_a_job_starts_with_the_pods_that_land_and_grows_as_more_do(operator: Kube) -> None:
    kube = operator
    nodes = sorted(n["metadata"]["name"] for n in kube.get("/api/v1/nodes")["items"])  # type: ignore[index]
    body = job(4, minReplicas=2)
    # A worker asks for 3.5 of a node's 8 CPUs: two fit a node. With one node open, 2 of 4 land.
    body["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3500m"
    closed = nodes[1:]
    kube.run("kubectl", "cordon", *closed)
    try:
        kube.apply(body)
        steps = Steps(kube)
        first = steps.wait(short_of(2), "training with the 2 pods that landed", STARTUP)
        degraded = condition(first, "Degraded")
        assert degraded["reason"] == "Unschedulable", degraded
        assert degraded["message"].startswith("2 of 4 pods missing, going on without them")
        assert "cannot be scheduled" in degraded["message"], degraded
        assert first["lastReconfiguration"]["reason"].startswith("start with 2 of 4 pods")

        kube.run("kubectl", "uncordon", closed[0])
        # Both pods land on the node opened: they pre-warm and join in one reconfiguration.
        grown = steps.wait(training(4, first["epoch"] + 1), "grown to 4", STARTUP)
        (last,) = [h for h in grown["history"] if h["reason"] == "scale 2 -> 4"]
        assert last["result"] == "committed", last
        assert last["from"].startswith("dp=2") and last["to"].startswith("dp=4"), last
        assert set(first["members"]) < set(grown["members"])
        degraded = condition(grown, "Degraded")
        assert degraded["status"] == "False", degraded

        # The two that stayed share a node and the two that joined the other: where the grow
        # left mirror pairs on one node, members are exchanged live (a respread) until none is.
        def parted(s: dict[str, Any]) -> bool:
            return training(4)(s) and (s.get("placement") or {}).get("mirrorPairsOnOneNode") == 0

        placed = steps.wait(parted, "no mirror pair on one node")
        steps.wait(lambda s: s.get("step", 0) > placed["step"], "training on with 4")
    finally:
        kube.run("kubectl", "uncordon", *closed, check=False)


def in_pods_of_two(kube: Kube, parallelism: dict[str, int], **spec: Any) -> Steps:
    """Apply a job of 2 pods of 2 GPUs each, a node's (its members train on CPU)."""
    body = job(2, parallelism=parallelism, **spec)
    limits = body["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["nvidia.com/gpu"] = 2
    kube.apply(body)
    return Steps(kube)


def test_pods_of_two_members_keep_tp_inside_scale_and_drain_whole(operator: Kube) -> None:
    # Each node has 2 GPUs: a worker of 2 (its members train on CPU) takes a node. tp=2 groups
    # stay inside pods; pods join and leave whole, each with one agent endpoint.
    kube = operator
    steps = in_pods_of_two(kube, {"tp": 2, "zero": 1})

    def pods_of(s: dict[str, Any]) -> list[str]:
        return [m.rsplit("-", 1)[0] for m in s["members"]]

    def tp_inside_pods(s: dict[str, Any]) -> bool:
        owners = pods_of(s)
        return all(owners[i] == owners[i + 1] for i in range(0, len(owners), 2))

    def running(pods: int, epoch: int | None = None) -> Callable[[dict[str, Any]], bool]:
        return lambda s: training(pods, epoch)(s) and len(s.get("members", [])) == 2 * pods

    first = steps.wait(running(2), "training with 2 pods of 2", STARTUP)
    assert first["layout"].startswith("dp=2,tp=2") and tp_inside_pods(first), first
    pods = members(kube)
    assert set(pods_of(first)) == set(pods) and len(pods) == 2
    # The pod's one endpoint answers for each of its members.
    secret = token(kube)
    for name in first["members"]:
        agent = agent_status(kube, pods[name.rsplit("-", 1)[0]], secret, member=name)
        assert agent.member == name and agent.epoch == first["epoch"]

    kube.kubectl("scale", f"etj/{JOB}", "--replicas=3")
    grown = steps.wait(running(3, first["epoch"] + 1), "grown to 3 pods", STARTUP)
    assert grown["layout"].startswith("dp=3,tp=2") and tp_inside_pods(grown), grown
    assert set(first["members"]) < set(grown["members"])
    steps.wait(lambda s: s.get("step", 0) > grown["step"], "training on with 3 pods")

    # A drained node's pod leaves whole, in one live reconfiguration; its replacement cannot be
    # placed (every other node's GPUs are taken) until the node is back.
    pods = members(kube)
    victim = pods_of(grown)[-1]
    node = pods[victim]["spec"]["nodeName"]
    try:
        drain = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s"]
        kube.run("kubectl", *drain, "--pod-selector", f"liveshard.io/job={JOB}", timeout=300)
        drained = steps.wait(running(2, grown["epoch"] + 1), "trained on by 2 pods")
        assert victim not in pods_of(drained) and tp_inside_pods(drained), drained
        (evicted,) = [h for h in drained["history"] if h["reason"].startswith("evicting")]
        assert evicted["reason"] == f"evicting {victim}-0, {victim}-1", evicted
        assert evicted["result"] == "committed", evicted
    finally:
        kube.run("kubectl", "uncordon", node, check=False)
    back = steps.wait(running(3, drained["epoch"] + 1), "back to 3 pods", STARTUP)
    assert tp_inside_pods(back)

    # One member's process dies: its pod ends with it, and both are recovered in memory at once.
    pod = members(kube)[pods_of(back)[0]]
    os.kill(member_pid(pod, f"{pod['metadata']['name']}-1"), signal.SIGKILL)
    lost = {f"{pod['metadata']['name']}-{k}" for k in range(2)}
    recovered = steps.wait(
        lambda s: not lost & set(s.get("members", lost)) and s.get("phase") == "Running",
        "a recovery without the pod",
    )
    last = recovered["lastReconfiguration"]
    assert last["result"] == "committed" and last["reason"].startswith("lost "), last
    assert all(m in last["reason"] for m in lost) and "restore" not in last["reason"], last
    assert recovered["step"] >= back["step"]  # from memory: no step went back
    steps.wait(lambda s: s.get("step", 0) > recovered["step"], "training on")


def test_a_pod_holding_a_whole_stage_without_replicas_is_recovered_in_memory(
    operator: Kube,
) -> None:  # fmt: skip
    # Two pods of 2 on two nodes of 2 GPUs, tp=2 inside pods, pp=2, dp=1, mirrored: each box's
    # copy is on the other pod's stage, so a pod's loss (its whole tp group) loses no byte. Its
    # replacement takes the dead pod's GPUs, on its node; the dead pod, kept for its logs by
    # default, is deleted once the job recovered from it (a history limit of 0).
    kube = operator
    steps = in_pods_of_two(
        kube, {"tp": 2, "pp": 2}, faultTolerance={"snapshots": True, "failedPodsHistoryLimit": 0}
    )
    first = steps.wait(lambda s: training(2)(s) and len(s["members"]) == 4, "training", STARTUP)
    assert first["layout"].startswith("dp=1,tp=2,pp=2") and "mirror=1" in first["layout"], first
    owners = [m.rsplit("-", 1)[0] for m in first["members"]]
    assert owners[0] == owners[1] != owners[2] == owners[3], first["members"]
    assert first["placement"]["mirrorPairsOnOneNode"] == 0, first["placement"]
    pod = members(kube)[owners[0]]
    os.kill(member_pid(pod, f"{owners[0]}-0"), signal.SIGKILL)
    lost = {f"{owners[0]}-{k}" for k in range(2)}
    recovered = steps.wait(
        lambda s: not lost & set(s.get("members", lost)) and s.get("phase") == "Running",
        "a recovery with the pod's replacement", STARTUP,
    )  # fmt: skip
    last = recovered["lastReconfiguration"]
    assert last["result"] == "committed" and last["from"] == last["to"] == first["layout"], last
    assert last["reason"] == f"lost {owners[0]}-0, {owners[0]}-1", last
    assert recovered["step"] >= first["step"]  # from memory: no step went back
    steps.wait(lambda s: s.get("step", 0) > recovered["step"], "training on")
    wait_until(lambda: owners[0] not in members(kube), 30, f"the ended pod {owners[0]} deleted")


def test_a_suspended_job_resumes_in_another_layout_at_the_same_step(
    operator: Kube, tmp_path: Path
) -> None:
    kube = operator
    saved = tmp_path / "checkpoints"
    steps, start = started(kube, 2, checkpoint={"path": str(saved)})
    kube.kubectl("patch", "etj", JOB, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    suspended = steps.wait(lambda s: s.get("phase") == "Suspended", "suspended")
    step = suspended["step"]
    assert step >= start["step"] and suspended["replicas"] == 0
    said = condition(suspended, "Suspended")
    assert said["status"] == "True" and said["reason"] == "JobSuspended"
    path = suspended["reconfiguration"]["suspended"]["path"]
    assert said["message"] == f"the state of step {step} is saved in {path}"
    assert json.loads((Path(path) / "liveshard.json").read_text())["scalars"]["step"] == step
    wait_until(lambda: not members(kube) or None, 60, "every pod released")
    assert "Suspended" in event_reasons(kube)

    # Resumed with more capacity: another layout, the same step and data cursor.
    resume = {"spec": {"suspend": False, "replicas": 3}}
    kube.kubectl("patch", "etj", JOB, "--type=merge", "-p", json.dumps(resume))
    resumed = steps.wait(training(3, start["epoch"] + 1), "resumed with 3", STARTUP)
    last = resumed["lastReconfiguration"]
    assert last["reason"].startswith(f"resume from {path} (step {step})"), last
    assert last["result"] == "committed" and last["to"].startswith("dp=3"), last
    assert resumed["step"] >= step
    said = condition(resumed, "Suspended")
    assert (said["status"], said["reason"]) == ("False", "JobResumed")
    secret, pods = token(kube), members(kube)
    for name in resumed["members"]:
        agent = agent_status(kube, pods[name], secret)
        assert agent.samples == agent.step * GLOBAL_BATCH, (name, agent.samples, agent.step)
    steps.wait(lambda s: s.get("step", 0) > resumed["step"], "training on after the resume")


def test_the_hpa_example_targets_the_jobs_scale_subresource(operator: Kube) -> None:
    kube = operator
    kube.apply(job(2))
    hpa = ROOT / "examples" / "hpa.yaml"
    done = kube.kubectl("apply", "--dry-run=server", "-f", str(hpa), "-o", "json")
    applied = json.loads(done.stdout)
    assert applied["spec"]["scaleTargetRef"] == {
        "apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "name": JOB,
    }  # fmt: skip
    # What the autoscaler reads and writes: the scale subresource, with the members' selector.
    path = f"{API}/namespaces/{kube.namespace}/elastictrainingjobs/{JOB}/scale"
    scale = wait_until(lambda: (s := kube.get(path)) and s["status"].get("selector") and s, 60,
                       "the job's scale with its selector")  # fmt: skip
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["selector"] == f"liveshard.io/job={JOB},liveshard.io/role=member"


def test_gang_scheduled_workers_form_a_pod_group_and_pass_restricted_pod_security(
    operator: Kube,
) -> None:
    kube = operator
    # Pods that are not restricted-compliant (root, privilege escalation, ...) are refused here.
    restricted = "pod-security.kubernetes.io/enforce=restricted"
    kube.run("kubectl", "label", "namespace", kube.namespace, restricted)
    install_crd(kube, find_binaries().pod_group_crd, ("podgroups.scheduling.x-k8s.io",))
    kube.apply(job(3, minReplicas=2, scheduling={"gang": True, "pendingTimeoutSeconds": 120}))
    path = f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{kube.namespace}/podgroups/{JOB}"
    group = wait_until(lambda: kube.get(path), 60, "the job's PodGroup")
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 120}
    (owner,) = group["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("ElasticTrainingJob", JOB)
    pods = wait_until(lambda: len(members(kube)) == 3 and members(kube), 60, "3 workers")
    for name, pod in pods.items():
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == JOB, name
        assert pod["spec"]["automountServiceAccountToken"] is False, name


def test_gang_scheduled_volcano_workers_form_a_volcano_pod_group(operator: Kube) -> None:
    kube = operator
    kube.run("kubectl", "apply", "--server-side", "-f", str(VOLCANO_PODGROUP_CRD))
    crd = "crd/podgroups.scheduling.volcano.sh"
    wait_until(lambda: kube.run("kubectl", "get", crd, check=False).returncode == 0 or None, 60,
               "Volcano's PodGroup kind served")  # fmt: skip
    body = job(2, minReplicas=2, scheduling={"gang": True})
    template = body["spec"]["template"]
    template.setdefault("metadata", {}).setdefault("annotations", {})[
        "scheduling.volcano.sh/queue-name"
    ] = "research"
    template["spec"]["schedulerName"] = "volcano"
    kube.apply(body)
    path = f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{kube.namespace}/podgroups/{JOB}"
    group = wait_until(lambda: kube.get(path), 60, "the job's Volcano PodGroup")
    assert group["spec"] == {"minMember": 2, "queue": "research"}
    pods = wait_until(lambda: len(members(kube)) == 2 and members(kube), 60, "2 workers")
    for name, pod in pods.items():
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == JOB, name
        # No Volcano scheduler runs here: its pods wait for it, unplaced.
        assert pod["spec"]["schedulerName"] == "volcano" and not pod["spec"].get("nodeName")


def test_a_worker_killed_without_notice_is_recovered_in_memory(operator: Kube) -> None:
    kube = operator
    # The example's ZeRO-1, its shards mirrored (snapshots, the default): the dead member's
    # shards are also held by the next member, wherever in a step it dies.
    steps, start = started(kube, 3, parallelism={"zero": 1})
    assert start["layout"].endswith(",mirror=1"), start["layout"]
    held = start["stateBytes"]  # what the mirror costs: one more shard's optimizer state
    assert 0 < held["mirroredPerMember"] < held["perMember"], held
    victim = start["members"][1]
    before = members(kube)
    kube.kubectl("delete", "pod", victim, "--grace-period=0", "--force")

    def recovered(s: dict[str, Any]) -> bool:
        last = s.get("lastReconfiguration") or {}
        return victim not in s.get("members", [victim]) and "lost" in last.get("reason", "")

    after = steps.wait(lambda s: recovered(s) and s.get("phase") == "Running", "a recovery")
    last = after["lastReconfiguration"]
    assert last["result"] == "committed" and last["epoch"] > start["epoch"], last
    assert f"lost {victim}" in last["reason"] and "restore" not in last["reason"]
    assert after["step"] >= start["step"]  # from memory: no step went back
    survivors = [m for m in start["members"] if m != victim]
    assert set(survivors) <= set(after["members"])
    # The survivors kept their processes: the same pods, never restarted.
    pods = members(kube)
    for name in survivors:
        assert pods[name]["metadata"]["uid"] == before[name]["metadata"]["uid"]
        assert pods[name]["status"]["containerStatuses"][0]["restartCount"] == 0
    # A replacement pod pre-warms and joins: the job is back to 3 members, and trains on.
    back = steps.wait(training(3, after["epoch"] + 1), "back to 3 members", STARTUP)
    steps.wait(lambda s: s.get("step", 0) > back["step"], "training on")


def test_a_node_lost_with_its_members_is_recovered_in_memory(operator: Kube) -> None:
    kube = operator
    # Four workers spread over the cluster's nodes, two on one at least; the mirrored ZeRO-1
    # layout puts each shard's two holders (neighbours on the ring of 4) on two nodes.
    steps, start = started(kube, 4, parallelism={"zero": 1})
    node_of = {name: pod["spec"]["nodeName"] for name, pod in members(kube).items()}
    ring = [node_of[m] for m in start["members"]]
    assert all(a != b for a, b in zip(ring, ring[1:] + ring[:1], strict=True)), ring
    assert start["placement"] == {"nodes": len(set(ring)), "mirrorPairs": 4,
                                  "mirrorPairsOnOneNode": 0}  # fmt: skip
    node = max(ring, key=ring.count)
    victims = [m for m in start["members"] if node_of[m] == node]
    assert len(victims) == 2, ring
    kube.kubectl("delete", "pod", *victims, "--grace-period=0", "--force")

    def recovered(s: dict[str, Any]) -> bool:
        last = s.get("lastReconfiguration") or {}
        return not set(victims) & set(s.get("members", victims)) and "lost" in last.get(
            "reason", ""
        )

    after = steps.wait(lambda s: recovered(s) and s.get("phase") == "Running", "a recovery")
    last = after["lastReconfiguration"]
    assert last["result"] == "committed" and "restore" not in last["reason"], last
    assert all(v in last["reason"] for v in victims), last
    assert after["step"] >= start["step"]  # from memory: no step went back
    # Replacements pre-warm and join wherever they land: back to 4 members, training on.
    back = steps.wait(training(4, after["epoch"] + 1), "back to 4 members", STARTUP)
    steps.wait(lambda s: s.get("step", 0) > back["step"], "training on")


def test_a_pipeline_whose_first_layers_freeze_is_rebalanced_live(operator: Kube) -> None:
    kube = operator
    # pp=2 on 2 workers, 2 of the 4 layers each; from step 4 the first 2 layers are frozen
    # (forward only): the second stage paces the step until a layer moves to the first, which
    # wins about a third of the step. Returning to 2:2 needs twice the threshold (30 %): a member
    # slowed by the machine's other processes over most of a window cannot fake that.
    training = {**job(2)["spec"]["training"], "freeze": [{"step": 4, "layers": 2}]}
    rebalance = {"enabled": True, "windowSteps": 5, "threshold": 0.15}
    steps, start = started(kube, 2, parallelism={"pp": 2, "zero": 0}, training=training,
                           rebalance=rebalance)  # fmt: skip

    def rebalanced(s: dict[str, Any]) -> bool:
        return any(h.get("reason", "").startswith("rebalance:") and h["result"] == "committed"
                   for h in s.get("history", []))  # fmt: skip

    after = steps.wait(lambda s: rebalanced(s) and s.get("phase") == "Running", "a rebalance")
    (done,) = [h for h in after["history"] if h["reason"].startswith("rebalance:")]
    assert parse_degrees(done["to"]).pp_layers == (3, 1), done
    assert set(after["members"]) == set(start["members"])  # the same pods: layers moved
    assert "Rebalance" in event_reasons(kube)
    # Kept as it is: the next passes measure it and leave it (no switch back to 2:2).
    later = steps.wait(lambda s: s.get("step", 0) > after["step"] + 12, "training on")
    assert later["epoch"] == after["epoch"] and "imbalance" in later, later


def test_a_hung_worker_is_taken_out_once_the_others_world_breaks(operator: Kube) -> None:
    kube = operator
    steps, start = started(kube, 3, parallelism={"zero": 0})
    victim = start["members"][2]
    container = members(kube)[victim]["status"]["containerStatuses"][0]["containerID"]
    pid = int(container.removeprefix("process://"))
    os.killpg(pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
    try:
        # The others' collectives time out (opTimeoutSeconds), their world breaks, and the
        # operator takes the silent member out.
        after = steps.wait(lambda s: victim not in s.get("members", [victim])
                           and s.get("phase") == "Running", "a recovery without it")  # fmt: skip
        last = after["lastReconfiguration"]
        assert last["result"] == "committed" and f"lost {victim}" in last["reason"], last
        steps.wait(lambda s: s.get("step", 0) > after["step"], "training on")
        pod = kube.get(f"/api/v1/namespaces/{kube.namespace}/pods/{victim}")
        assert pod is None or pod["metadata"].get("deletionTimestamp")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_a_worker_lost_with_the_only_copy_of_its_state_restores_the_last_checkpoint(
    operator: Kube, tmp_path: Path
) -> None:
    kube = operator
    # ZeRO-1 (the example's) on 2 members, its shards not mirrored: each holds the only copy of
    # half the optimizer state.
    saved = tmp_path / "checkpoints"
    kube.apply(job(2, checkpoint={"path": str(saved), "everySteps": 3},
                   faultTolerance={"snapshots": False}))  # fmt: skip
    steps = Steps(kube)
    start = steps.wait(training(2), "training with 2", STARTUP)
    written = wait_until(lambda: list(saved.glob("step-*/liveshard.json")), 120, "a checkpoint")
    checkpoint_step = json.loads(written[0].read_text())["scalars"]["step"]
    steps.wait(lambda s: s.get("step", 0) > checkpoint_step, "training past the checkpoint")
    victim = start["members"][1]
    kube.kubectl("delete", "pod", victim, "--grace-period=0", "--force")

    def restored(s: dict[str, Any]) -> dict[str, Any] | None:
        last = s.get("lastReconfiguration") or {}
        ok = last.get("result") == "committed" and "restore from" in last.get("reason", "")
        return s if ok and s.get("phase") == "Running" else None

    after = wait_until(lambda: restored(status(kube)), 180, "a restore from the checkpoint",
                       describe=lambda: json.dumps(status(kube))[:2000])  # fmt: skip
    last = after["lastReconfiguration"]
    assert f"loss of {victim}" in last["reason"] and "no surviving copy" in last["reason"]
    assert str(saved) in last["reason"] and victim not in after["members"]
    assert after["step"] >= checkpoint_step  # from a checkpoint's step on
    assert "ReconfigurationAborted" in event_reasons(kube)  # the recovery in memory could not be
    # The job trains on from the checkpoint, and grows back to 2 members.
    wait_until(lambda: training(2, after["epoch"] + 1)(status(kube)) or None, STARTUP,
               "back to 2 members", describe=lambda: json.dumps(status(kube))[:2000])  # fmt: skip


def test_a_finished_job_is_exported_as_a_hugging_face_directory(
    operator: Kube, tmp_path: Path
) -> None:
    kube = operator
    out = tmp_path / "hf"
    spec = {"path": str(tmp_path / "checkpoints"), "exportTo": str(out)}
    body = job(2, checkpoint=spec)
    body["spec"]["training"]["steps"] = 8
    kube.apply(body)
    done = Steps(kube).wait(lambda s: s.get("phase") == "Succeeded", "Succeeded", STARTUP)
    assert done.get("exportedTo") == str(out) and done["step"] == 8, json.dumps(done)[:3000]
    succeeded = condition(done, "Succeeded")
    assert succeeded["message"] == f"trained 8 steps; exported step 8 to {out}"
    saved = json.loads((tmp_path / "checkpoints" / "step-8" / "liveshard.json").read_text())
    assert saved["scalars"]["step"] == 8
    exported = HfModel.load(out)
    assert exported.has_weights and (out / "tokenizer.json").is_file()
    assert exported.config == replace(CONFIGS["qwen3-tiny"], name=exported.config.name)
    wait_until(lambda: not members(kube) or None, 60, "the pods deleted")


def test_a_count_no_layout_can_use_leaves_hot_spares(operator: Kube) -> None:
    kube = operator
    # dp must divide 24 / 2 = 12: 5 members can use only 4.
    kube.apply(job(5))
    steps = Steps(kube)
    running = steps.wait(lambda s: training(4)(s) and len(s.get("spares", [])) == 1,
                         "4 members and a spare", STARTUP)  # fmt: skip
    degraded = condition(running, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "HotSpares"
    assert "no layout" in degraded["message"]


def test_a_tp_the_model_cannot_take_is_a_condition_naming_it(operator: Kube) -> None:
    kube = operator
    kube.apply(job(2, parallelism={"tp": 3, "zero": 1}))
    steps = Steps(kube)

    def invalid(s: dict[str, Any]) -> bool:
        return condition(s, "Ready").get("reason") == "InvalidSpec"

    bad = steps.wait(invalid, "an InvalidSpec condition")
    ready = condition(bad, "Ready")
    assert ready["status"] == "False"
    assert "tp=3 must divide heads=4" in ready["message"]
    assert not kube.pods(f"liveshard.io/job={JOB}")  # nothing was started for it


def test_workers_that_cannot_start_are_replaced_with_backoff_then_fail_the_job(
    operator: Kube,
) -> None:
    kube = operator
    training = {**example("tiny-job")["spec"]["training"], "data": "/nonexistent/corpus.jsonl"}
    kube.apply(job(1, training=training, scheduling={"maxStartFailures": 2}))
    steps = Steps(kube)
    crashing = steps.wait(lambda s: bool((s.get("reconfiguration") or {}).get("startFailures")),
                          "a failed start counted", STARTUP)  # fmt: skip
    degraded = condition(crashing, "Degraded")
    # The agent's refusal, as the kubelet kept its last log lines.
    assert degraded["reason"] == "WorkerCrashing" and "exit code 2" in degraded["message"]
    assert "/nonexistent/corpus.jsonl: no such file" in degraded["message"]

    def failed(s: dict[str, Any]) -> bool:
        return condition(s, "Failed").get("status") == "True"

    done = steps.wait(failed, "the job Failed", STARTUP)
    failure = condition(done, "Failed")
    assert done["phase"] == "Failed" and failure["reason"] == "WorkersCrashing"
    row = done["reconfiguration"]["startFailures"]
    # The second pod came after the first one's 10 s backoff, not at the next pass.
    first = crashing["reconfiguration"]["startFailures"]
    assert row["count"] == 2 and row["at"] - first["at"] >= 10
    assert event_reasons(kube).count("WorkerCrashing") == 2
    assert len(members(kube)) == 1  # the last failed pod, kept for its logs


def test_operator_killed_mid_reconfiguration_ends_in_one_epoch(operator: Kube) -> None:
    kube = operator
    kube.apply(job(2))
    steps = Steps(kube)
    start = steps.wait(training(2), "training with 2", STARTUP)
    kube.kubectl("scale", f"etj/{JOB}", "--replicas=4")
    # Kill the operator as soon as the reconfiguration is recorded in flight.
    in_flight = steps.wait(lambda s: bool((s.get("reconfiguration") or {}).get("inFlight")),
                           "a reconfiguration in flight", STARTUP)  # fmt: skip
    assert in_flight["reconfiguration"]["inFlight"]["epoch"] > start["epoch"]
    kube.kubectl("delete", "pod", "-l", "app.kubernetes.io/name=liveshard", "--wait=false")
    done = steps.wait(lambda s: training(4, start["epoch"] + 1)(s), "4 members after the restart",
                      STARTUP)  # fmt: skip
    # Every member trains in the same, committed epoch.
    secret = token(kube)
    pods = members(kube)
    epochs = {agent_status(kube, pods[m], secret).epoch for m in done["members"]}
    assert epochs == {done["epoch"]}
    steps.wait(lambda s: s.get("step", 0) > done["step"], "training on")


def test_an_agent_call_without_the_token_is_refused_and_its_certificate_renewed_live(
    operator: Kube,
) -> None:
    kube = operator
    kube.apply(job(1))
    Steps(kube).wait(training(1), "training with 1", STARTUP)
    (pod,) = members(kube).values()
    # The job's NetworkPolicy names the job's workers and the running operator's pod, and lets
    # the operator in on the agent's port only.
    base = f"/apis/networking.k8s.io/v1/namespaces/{kube.namespace}/networkpolicies"
    policy = kube.get(f"{base}/{JOB}")
    assert policy is not None and policy["metadata"]["ownerReferences"][0]["name"] == JOB
    own, operator, scrape = policy["spec"]["ingress"]
    assert own["from"] == [{"podSelector": policy["spec"]["podSelector"]}]
    assert [p["metadata"]["name"] for p in kube.pods(selector(policy["spec"]["podSelector"]))] == [
        pod["metadata"]["name"]
    ]
    (peer,) = operator["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": kube.namespace
    }
    (chosen,) = kube.pods(selector(peer["podSelector"]))
    assert chosen["spec"]["containers"][0]["command"] == ["liveshard-operator"]
    assert operator["ports"] == [{"protocol": "TCP", "port": pod_port(pod, "agent")}]
    assert scrape == {"ports": [{"protocol": "TCP", "port": pod_port(pod, "metrics")}]}
    # Opened by hand to everyone: the operator puts its rules back.
    kube.kubectl("patch", "networkpolicy", JOB, "--type", "merge", "-p",
                 json.dumps({"spec": {"ingress": [{}]}}))  # fmt: skip

    def restored() -> bool:
        now = kube.get(f"{base}/{JOB}")
        return now is not None and now["spec"] == policy["spec"]

    wait_until(restored, 30, "the job's NetworkPolicy put back")
    for wrong in (None, "not-the-token"):
        with pytest.raises(grpc.RpcError) as err:
            agent_status(kube, pod, wrong)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Without the operator's client certificate, even the token gets no answer: the handshake
    # fails (what worker code holds, the serving pair and the CA certificate, is no client's).
    with pytest.raises(grpc.RpcError) as err:
        agent_status(kube, pod, token(kube), tls=False)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert set(secret_data(kube, f"{JOB}-agent-tls")) == {"ca.crt", "tls.crt", "tls.key"}
    # The refusals changed nothing: the agent serves and trains on.
    assert agent_status(kube, pod, token(kube)).phase == pb.AgentStatus.TRAINING

    # The workers' certificate nears its end (a pair of ten seconds, from the job's CA, put in
    # their Secret): the operator renews it from the same CA and the agent serves the new one,
    # without a restart.
    served = agent_status(kube, pod, token(kube)).serving_certificate
    assert served == pki.fingerprint(secret_data(kube, f"{JOB}-agent-tls")["tls.crt"])
    ca = secret_data(kube, f"{JOB}-operator-tls")
    short = pki.serving_pair(pki.Authority(ca["ca.crt"], ca["ca.key"]), JOB, kube.namespace,
                             validity=dt.timedelta(seconds=10))  # fmt: skip
    encoded = {"tls.crt": short.cert, "tls.key": short.key}
    patch = {"data": {k: base64.b64encode(v).decode() for k, v in encoded.items()}}
    kube.kubectl("patch", "secret", f"{JOB}-agent-tls", "--type", "merge", "-p", json.dumps(patch))

    def renewed() -> str | None:
        cert = secret_data(kube, f"{JOB}-agent-tls")["tls.crt"]
        if cert == short.cert:
            return None
        now = agent_status(kube, pod, token(kube)).serving_certificate
        return now if now == pki.fingerprint(cert) else None

    def state() -> str:
        cert = secret_data(kube, f"{JOB}-agent-tls")["tls.crt"]
        now = agent_status(kube, pod, token(kube)).serving_certificate
        return f"Secret's {'short' if cert == short.cert else pki.fingerprint(cert)}, served {now}"

    assert wait_until(renewed, 60, "the renewed certificate served", describe=state) != served
    assert "CertificateRenewed" in event_reasons(kube)
    assert agent_status(kube, pod, token(kube)).phase == pb.AgentStatus.TRAINING

    # The job's CA rotated on demand: the new CA is trusted beside the old until the agent
    # serves a certificate of it, then alone; the agent trains on throughout, and the operator's
    # certificate of the old CA is refused after.
    before = secret_data(kube, f"{JOB}-operator-tls")
    kube.kubectl("annotate", "etj", JOB, "liveshard.io/rotate-ca=1")

    def rotated() -> bytes | None:
        (ca, *others) = pki.certificates(secret_data(kube, f"{JOB}-operator-tls")["ca.crt"])
        agent = secret_data(kube, f"{JOB}-agent-tls")
        if others or ca == before["ca.crt"] or agent["ca.crt"] != ca:
            return None
        now = agent_status(kube, pod, token(kube)).serving_certificate
        return ca if now == pki.fingerprint(agent["tls.crt"]) else None

    def rotation() -> str:
        data = secret_data(kube, f"{JOB}-operator-tls")
        return f"{len(pki.certificates(data['ca.crt']))} CAs trusted; events {event_reasons(kube)}"

    ca = wait_until(rotated, 90, "the CA rotated", describe=rotation)
    assert pki.issued_by(secret_data(kube, f"{JOB}-operator-tls")["tls.crt"], ca)
    assert {"CARotationStarted", "CARotated"} <= set(event_reasons(kube))
    with pytest.raises(grpc.RpcError) as err:
        agent_status(kube, pod, token(kube), operator={**before, "ca.crt": ca})
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    trained = agent_status(kube, pod, token(kube))
    assert trained.phase == pb.AgentStatus.TRAINING
    Steps(kube).wait(lambda s: s.get("step", 0) > trained.step, "training on")
    # The policy as stored (with the API server's defaults) is what the operator renders: only
    # the pass after the hand edit found it out of date.
    log = kube.logs(chosen["metadata"]["name"])
    assert log.count(f"job {JOB}: its NetworkPolicy's rules are out of date") == 1


def test_cert_manager_issues_the_jobs_certificates_and_its_renewal_is_served_live(
    kube: Kube, tmp_path: Path
) -> None:
    kinds = ("issuers.cert-manager.io", "certificates.cert-manager.io")
    install_crd(kube, CERT_MANAGER_CRDS, kinds)
    with installed(kube, tmp_path, certManager={"enabled": True}) as kube:
        kube.apply(job(2))
        steps = Steps(kube)
        # Nothing issued yet: the job waits, saying for what, and no worker is created.
        waiting = steps.wait(
            lambda s: condition(s, "Ready").get("reason") == "CertificatesPending",
            "waiting for its certificates",
        )
        assert f"{JOB}-agent-tls" in condition(waiting, "Ready")["message"]
        assert not members(kube)
        base = f"{CERT_MANAGER_API}/namespaces/{kube.namespace}"
        made = {
            (o["kind"], o["metadata"]["name"]): o
            for plural in ("issuers", "certificates")
            for o in (kube.get(f"{base}/{plural}") or {})["items"]
        }
        names = {f"{JOB}-selfsigned", f"{JOB}-ca"}
        assert set(made) == {("Issuer", n) for n in names} | {
            ("Certificate", n) for n in (f"{JOB}-ca", f"{JOB}-agent-tls", f"{JOB}-operator-tls")
        }
        assert all(o["metadata"]["ownerReferences"][0]["name"] == JOB for o in made.values())
        serving = made[("Certificate", f"{JOB}-agent-tls")]["spec"]
        assert serving["dnsNames"] == [pki.server_name(JOB, kube.namespace)]
        assert serving["usages"] == ["digital signature", "server auth"]

        with CertManager(kube) as cert_manager:
            steps.wait(training(2), "training with 2", STARTUP)
            ca = secret_data(kube, f"{JOB}-ca")["tls.crt"]
            agent = secret_data(kube, f"{JOB}-agent-tls")
            operator = secret_data(kube, f"{JOB}-operator-tls")
            assert agent["ca.crt"] == operator["ca.crt"] == ca
            assert pki.issued_by(agent["tls.crt"], ca) and pki.issued_by(operator["tls.crt"], ca)
            assert "ca.key" not in operator  # the operator issued nothing itself
            for secret in (f"{JOB}-agent-tls", f"{JOB}-operator-tls"):
                body = kube.get(f"/api/v1/namespaces/{kube.namespace}/secrets/{secret}")
                assert body is not None
                assert body["metadata"]["ownerReferences"][0]["name"] == JOB
            pods = members(kube)
            served = pki.fingerprint(agent["tls.crt"])
            assert {agent_status(kube, p, token(kube)).serving_certificate
                    for p in pods.values()} == {served}  # fmt: skip

            # cert-manager renews the serving certificate (a new key): every agent serves it
            # without a restart, and the job trains on.
            renewed = pki.fingerprint(cert_manager.renew(f"{JOB}-agent-tls"))
            assert renewed != served

            def serving_renewed() -> bool:
                now = {agent_status(kube, p, token(kube)).serving_certificate
                       for p in pods.values()}  # fmt: skip
                return now == {renewed}

            wait_until(serving_renewed, 60, "the renewed certificate served by every agent")
            assert {p["metadata"]["uid"] for p in members(kube).values()} == {
                p["metadata"]["uid"] for p in pods.values()
            }
            trained = agent_status(kube, next(iter(pods.values())), token(kube))
            assert trained.phase == pb.AgentStatus.TRAINING
            steps.wait(lambda s: s.get("step", 0) > trained.step, "training on")


def test_a_users_issuer_issues_the_jobs_certificates_and_no_ca_is_made_per_job(
    kube: Kube, tmp_path: Path
) -> None:
    kinds = ("issuers.cert-manager.io", "certificates.cert-manager.io")
    install_crd(kube, CERT_MANAGER_CRDS, kinds)
    # The user's CA, behind an Issuer of theirs.
    corp = pki.new_authority()
    pair = {"tls.crt": corp.cert, "tls.key": corp.key}
    kube.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": "corp-ca"},
                "data": {k: base64.b64encode(v).decode() for k, v in pair.items()}})  # fmt: skip
    kube.apply({"apiVersion": "cert-manager.io/v1", "kind": "Issuer", "metadata": {
        "name": "corp-ca"}, "spec": {"ca": {"secretName": "corp-ca"}}})  # fmt: skip
    values = {"certManager": {"enabled": True, "issuerRef": {"name": "corp-ca"}}}
    with installed(kube, tmp_path, **values) as kube, CertManager(kube):
        kube.apply(job(1))
        Steps(kube).wait(training(1), "training with 1", STARTUP)
        agent = secret_data(kube, f"{JOB}-agent-tls")
        operator = secret_data(kube, f"{JOB}-operator-tls")
        assert agent["ca.crt"] == operator["ca.crt"] == corp.cert
        assert pki.issued_by(agent["tls.crt"], corp.cert)
        assert pki.issued_by(operator["tls.crt"], corp.cert)
        base = f"{CERT_MANAGER_API}/namespaces/{kube.namespace}"
        made = {(o["kind"], o["metadata"]["name"])
                for plural in ("issuers", "certificates")
                for o in (kube.get(f"{base}/{plural}") or {})["items"]}  # fmt: skip
        assert made == {("Issuer", "corp-ca"), ("Certificate", f"{JOB}-agent-tls"),
                        ("Certificate", f"{JOB}-operator-tls")}  # fmt: skip
        (pod,) = members(kube).values()
        status = agent_status(kube, pod, token(kube))
        assert status.serving_certificate == pki.fingerprint(agent["tls.crt"])
        assert status.phase == pb.AgentStatus.TRAINING
