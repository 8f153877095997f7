"""Namespace deletion and owner-reference garbage collection (the controller manager's
namespace and garbage-collector controllers). Needs the local cluster."""

from __future__ import annotations

from liveshard_e2e.testing import Kube, python_pod, running
from liveshard_e2e.waiting import wait_until


def test_namespace_deletion_completes(kube: Kube) -> None:
    other = kube.create_namespace(f"{kube.namespace}-x")
    other.kubectl("create", "configmap", "data", "--from-literal=a=b")
    other.apply(
        python_pod("sleeper", "import time; time.sleep(3600)", terminationGracePeriodSeconds=2)
    )
    other.wait_pod("sleeper", running, "Running")
    kube.run("kubectl", "delete", "namespace", other.namespace, "--wait=false")
    wait_until(
        lambda: kube.get(f"/api/v1/namespaces/{other.namespace}") is None,
        90,
        f"namespace {other.namespace} to be deleted",
        describe=lambda: str(
            (kube.get(f"/api/v1/namespaces/{other.namespace}") or {}).get("status")
        ),
    )


def test_owner_referenced_children_are_collected(kube: Kube) -> None:
    parent = kube.rest.post(
        f"/api/v1/namespaces/{kube.namespace}/configmaps",
        {"metadata": {"name": "parent"}, "data": {"role": "owner"}},
    )
    owner = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "parent",
        "uid": parent["metadata"]["uid"],
    }
    for i in range(3):
        kube.rest.post(
            f"/api/v1/namespaces/{kube.namespace}/configmaps",
            {"metadata": {"name": f"child-{i}", "ownerReferences": [owner]}},
        )
    kube.kubectl("delete", "configmap", "parent")
    wait_until(
        lambda: (
            not [
                c
                for c in kube.rest.get(f"/api/v1/namespaces/{kube.namespace}/configmaps")["items"]
                if c["metadata"]["name"].startswith("child-")
            ]
        ),
        60,
        "the garbage collector to delete the children",
    )


def test_deleting_a_deployment_removes_its_pods(kube: Kube) -> None:
    kube.kubectl(
        "create",
        "deployment",
        "gone",
        "--image=python",
        "--replicas=2",
        "--",
        "python",
        "-c",
        "import time; time.sleep(3600)",
    )
    kube.kubectl("rollout", "status", "deployment/gone", "--timeout=90s", timeout=100)
    assert len(kube.pods("app=gone")) == 2
    kube.kubectl("delete", "deployment", "gone", "--cascade=foreground", "--wait=false")
    wait_until(
        lambda: not kube.pods("app=gone"),
        90,
        "the deployment's pods to be deleted",
        describe=lambda: str([p["metadata"]["name"] for p in kube.pods("app=gone")]),
    )
    wait_until(
        lambda: kube.get(f"/apis/apps/v1/namespaces/{kube.namespace}/deployments/gone") is None,
        60,
        "the deployment itself to go (foreground deletion)",
    )
