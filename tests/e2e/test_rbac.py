"""RBAC is really exercised: a pod's kubeconfig carries its service account's token, so the
API server answers 403 for what the account may not do. Needs the local cluster."""

from __future__ import annotations

from liveshard_e2e.testing import Kube, python_pod

CODE = """
import os, ssl, urllib.error, urllib.request, yaml
cfg = yaml.safe_load(open(os.environ["KUBECONFIG"]))
server = cfg["clusters"][0]["cluster"]["server"]
ctx = ssl.create_default_context(cafile=cfg["clusters"][0]["cluster"]["certificate-authority"])
req = urllib.request.Request(f"{server}/api/v1/namespaces/{os.environ['NS']}/pods",
    headers={"Authorization": "Bearer " + cfg["users"][0]["user"]["token"]})
try:
    urllib.request.urlopen(req, context=ctx)
    print("STATUS 200", flush=True)
except urllib.error.HTTPError as err:
    print(f"STATUS {err.code}", flush=True)
"""


def _pod(name: str, account: str) -> dict:  # type: ignore[type-arg]
    env = [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    return python_pod(
        name, CODE, serviceAccountName=account, restartPolicy="Never", container={"env": env}
    )


def test_pod_without_permission_gets_403_and_with_it_200(kube: Kube) -> None:
    kube.kubectl("create", "serviceaccount", "limited")
    kube.kubectl("create", "serviceaccount", "reader")
    kube.kubectl("create", "role", "pod-reader", "--verb=list", "--resource=pods")
    kube.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={kube.namespace}:reader",
    )
    kube.apply(_pod("denied", "limited"))
    kube.apply(_pod("allowed", "reader"))
    for name in ("denied", "allowed"):
        kube.wait_pod(name, lambda p: p["status"].get("phase") == "Succeeded", "Succeeded")
    assert "STATUS 403" in kube.logs("denied")
    assert "STATUS 200" in kube.logs("allowed")
