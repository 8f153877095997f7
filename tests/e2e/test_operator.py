"""The operator end to end on the local cluster: the chart installed with helm, the example job
applied with kubectl, resized with `kubectl scale`, a node drained, the operator killed.

Each test installs the chart (one operator pod) in its own namespace and runs a `tiny` job of 2-5
worker pods, each a local process that imports torch and trains on CPU.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until
from tests.e2e.deployment import API, CHART, example, install_crd, release_name

JOB = "tiny"
GLOBAL_BATCH = 24
STARTUP = 240  # seconds: pods start one torch import each, on 2 cores


@pytest.fixture
def operator(kube: Kube, tmp_path: Path) -> Iterator[Kube]:
    """The chart installed in the test's namespace, its operator watching that namespace."""
    install_crd(kube)
    release = release_name()
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"watchNamespaces": [kube.namespace]}))
    kube.run("helm", "install", release, str(CHART), "-n", kube.namespace, "-f", str(values),
             "--wait", "--timeout=120s", timeout=150)  # fmt: skip
    yield kube
    kube.kubectl("delete", "etj", "--all", "--wait=false", check=False)
    kube.run("helm", "uninstall", release, "-n", kube.namespace, "--wait", check=False)


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


def training(replicas: int, epoch: int | None = None) -> Callable[[dict[str, Any]], bool]:
    def check(s: dict[str, Any]) -> bool:
        return (s.get("phase") == "Running" and s.get("replicas") == replicas
                and s.get("readyReplicas") == replicas
                and (epoch is None or s.get("epoch", -1) >= epoch))  # fmt: skip

    return check


def members(kube: Kube) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in kube.pods(f"liveshard.io/job={JOB}")}


def agent_status(kube: Kube, pod: dict[str, Any], token: str | None) -> pb.AgentStatus:
    with grpc.insecure_channel(f"{pod['status']['podIP']}:7070") as channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return pb_grpc.AgentStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10,
                                                    metadata=metadata)  # fmt: skip


def token(kube: Kube) -> str:
    secret = kube.get(f"/api/v1/namespaces/{kube.namespace}/secrets/{JOB}-token")
    assert secret is not None
    return base64.b64decode(secret["data"]["token"]).decode()


def test_scale_down_and_up_live(operator: Kube) -> None:
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
    events = kube.kubectl("get", "events", "--field-selector", f"involvedObject.name={JOB}",
                          "-o", "json").stdout  # fmt: skip
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert reasons.count("Reconfigured") >= 3  # the first world, 4 -> 2, 2 -> 3


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


def test_a_count_no_layout_can_use_leaves_hot_spares(operator: Kube) -> None:
    kube = operator
    # dp must divide 24 / 2 = 12: 5 members can use only 4.
    kube.apply(job(5))
    steps = Steps(kube)
    running = steps.wait(lambda s: training(4)(s) and len(s.get("spares", [])) == 1,
                         "4 members and a spare", STARTUP)  # fmt: skip
    degraded = next(c for c in running["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "HotSpares"
    assert "no layout" in degraded["message"]


def test_a_tp_the_model_cannot_take_is_a_condition_naming_it(operator: Kube) -> None:
    kube = operator
    kube.apply(job(2, parallelism={"tp": 3, "zero": 1}))
    steps = Steps(kube)

    def invalid(s: dict[str, Any]) -> bool:
        return any(
            c["type"] == "Ready" and c["reason"] == "InvalidSpec" for c in s.get("conditions", [])
        )

    bad = steps.wait(invalid, "an InvalidSpec condition")
    ready = next(c for c in bad["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert "tp=3 must divide heads=4" in ready["message"]
    assert not kube.pods(f"liveshard.io/job={JOB}")  # nothing was started for it


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


def test_an_agent_call_without_the_token_is_refused(operator: Kube) -> None:
    kube = operator
    kube.apply(job(1))
    Steps(kube).wait(training(1), "training with 1", STARTUP)
    (pod,) = members(kube).values()
    for wrong in (None, "not-the-token"):
        with pytest.raises(grpc.RpcError) as err:
            agent_status(kube, pod, wrong)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The refusals changed nothing: the agent serves and trains on.
    assert agent_status(kube, pod, token(kube)).phase == pb.AgentStatus.TRAINING
