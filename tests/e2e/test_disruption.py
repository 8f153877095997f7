"""Voluntary and involuntary disruption: `kubectl drain` through the Eviction API with a
PodDisruptionBudget, and a node that stops heart-beating. Needs the local cluster; each test
restores the nodes it touched."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from liveshard_e2e.testing import Kube, ready, running
from liveshard_e2e.waiting import wait_until

SLEEP = ["python", "-c", "import time; time.sleep(3600)"]


def _deployment(name: str, replicas: int, nodes: list[str], **pod_spec: Any) -> dict[str, Any]:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                        ]
                    }
                ]
            }
        }
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "affinity": affinity,
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{"name": "main", "image": "python", "command": SLEEP}],
                    **pod_spec,
                },
            },
        },
    }


def _node(kube: Kube, name: str) -> dict[str, Any]:
    node = kube.get(f"/api/v1/nodes/{name}")
    assert node is not None, f"node {name} missing"
    return node


def _node_ready(node: dict[str, Any]) -> str:
    return next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")


def test_drain_evicts_through_eviction_api_and_honours_pdb(kube: Kube, tmp_path: Path) -> None:
    source, target = kube.info.nodes[1], kube.info.nodes[2]
    kube.run("kubectl", "cordon", target)
    drain: subprocess.Popen[str] | None = None
    try:
        kube.apply(_deployment("drained", 2, [source, target]))
        kube.kubectl("rollout", "status", "deployment/drained", "--timeout=90s", timeout=100)
        assert {p["spec"]["nodeName"] for p in kube.pods("app=drained")} == {source}
        kube.apply(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "drained"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "drained"}}},
            }
        )
        pdb_path = f"/apis/policy/v1/namespaces/{kube.namespace}/poddisruptionbudgets/drained"
        wait_until(
            lambda: (kube.get(pdb_path) or {}).get("status", {}).get("disruptionsAllowed") == 1,
            30,
            "the disruption controller to allow one disruption",
        )
        # While the target stays cordoned, the first eviction's replacement cannot run, so the
        # budget must hold the second pod back.
        output = tmp_path / "drain.out"
        with open(output, "w") as out:
            drain = subprocess.Popen(
                [
                    str(kube.info.kubectl),
                    "drain",
                    source,
                    "--pod-selector=app=drained",
                    "--timeout=120s",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=kube.env(),
            )
        wait_until(
            lambda: "violate the pod's disruption budget" in output.read_text(),
            60,
            "kubectl drain to report an eviction refused by the budget",
            describe=output.read_text,
        )
        on_source = [p for p in kube.pods("app=drained") if p["spec"].get("nodeName") == source]
        assert [p for p in on_source if not p["metadata"].get("deletionTimestamp")], (
            "one pod must still run on the drained node while the budget is exhausted"
        )
        kube.run("kubectl", "uncordon", target)
        assert drain.wait(timeout=120) == 0, output.read_text()
        assert output.read_text().count("evicted") == 2, output.read_text()
        pods = kube.pods("app=drained")
        assert pods and all(p["spec"]["nodeName"] == target for p in pods), pods
        kube.kubectl("rollout", "status", "deployment/drained", "--timeout=60s", timeout=70)
    finally:
        if drain is not None and drain.poll() is None:
            drain.kill()
            drain.wait()
        kube.run("kubectl", "uncordon", source, check=False)
        kube.run("kubectl", "uncordon", target, check=False)


def test_node_without_heartbeat_goes_not_ready_and_pods_are_evicted(kube: Kube) -> None:
    node = kube.info.nodes[2]
    short = [
        {
            "key": f"node.kubernetes.io/{t}",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 2,
        }
        for t in ("not-ready", "unreachable")
    ]
    kube.apply(_deployment("victim", 1, [node], tolerations=short))
    kube.kubectl("rollout", "status", "deployment/victim", "--timeout=60s", timeout=70)
    (first,) = kube.pods("app=victim")
    assert first["spec"]["nodeName"] == node and running(first) and ready(first)

    kube.set_heartbeat(node, enabled=False)
    try:
        wait_until(
            lambda: _node_ready(_node(kube, node)) != "True",
            60,
            f"node {node} to go NotReady",
            describe=lambda: str(_node(kube, node)["status"]),
        )
        taints = wait_until(
            lambda: [
                t
                for t in _node(kube, node)["spec"].get("taints") or []
                if t["effect"] == "NoExecute"
            ],
            30,
            f"a NoExecute taint on {node}",
        )
        assert taints[0]["key"] in (
            "node.kubernetes.io/unreachable",
            "node.kubernetes.io/not-ready",
        )
        kube.wait_pod_gone(first["metadata"]["name"], timeout=60)
    finally:
        kube.set_heartbeat(node, enabled=True)
    wait_until(
        lambda: (
            _node_ready(_node(kube, node)) == "True"
            and not any(
                t["effect"] == "NoExecute" for t in _node(kube, node)["spec"].get("taints") or []
            )
        ),
        60,
        f"node {node} Ready again without NoExecute taints",
    )
