"""Pods on the process kubelet: environment, pod IP, logs, restart policies, GPUs, and a
Deployment (the controller manager and scheduler at work). Needs the local cluster."""

from __future__ import annotations

import json
from pathlib import Path

from liveshard_e2e.testing import Kube, python_pod, ready, running
from liveshard_e2e.waiting import wait_until

ENV_DUMP = """
import json, os, socket, tempfile
tempfile.mkstemp()  # in the pod's own TMPDIR
sock = socket.socket()
sock.bind((os.environ["POD_IP"], 0))  # the pod IP is really usable by the process
keys = ["GREETING", "POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE", "FROM_CM", "FROM_SECRET",
        "CFG_mode", "APP_LABEL", "CPU_LIMIT", "ESCAPED", "HOSTNAME", "KUBECONFIG",
        "KUBERNETES_SERVICE_HOST", "CUDA_VISIBLE_DEVICES", "TMPDIR"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
import time
time.sleep(3600)
"""


def test_pod_runs_with_ip_env_and_logs(kube: Kube) -> None:
    kube.kubectl("create", "configmap", "cfg", "--from-literal=mode=fast", "--from-literal=k=v")
    kube.kubectl("create", "secret", "generic", "creds", "--from-literal=password=hunter2")
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    env = [
        {"name": "NAME", "value": "world"},
        {"name": "GREETING", "value": "hello $(NAME)"},
        {"name": "ESCAPED", "value": "$$(NAME)"},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "NODE", **field("spec.nodeName")},
        {"name": "APP_LABEL", **field("metadata.labels['app']")},
        {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
        {
            "name": "FROM_SECRET",
            "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
        },
        {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
    ]
    container = {
        "env": env,
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "resources": {"limits": {"cpu": "2", "memory": "1Gi"}},
    }
    kube.apply(python_pod("envdump", ENV_DUMP, container=container))
    pod = kube.wait_pod("envdump", lambda p: running(p) and ready(p), "Running and Ready")
    pod_ip = pod["status"]["podIP"]
    assert pod_ip.startswith("127.") and pod_ip != "127.0.0.1", pod["status"]
    assert pod["status"]["containerStatuses"][0]["state"]["running"]

    wait_until(lambda: "ENV " in kube.logs("envdump"), 30, "the ENV line in kubectl logs")
    line = next(x for x in kube.logs("envdump").splitlines() if x.startswith("ENV "))
    seen = json.loads(line[4:])
    assert seen["GREETING"] == "hello world"
    assert seen["ESCAPED"] == "$(NAME)"
    assert seen["POD_NAME"] == "envdump"
    assert seen["HOSTNAME"] == "envdump"
    assert seen["POD_NAMESPACE"] == kube.namespace
    assert seen["POD_IP"] == pod_ip
    assert seen["NODE"] == pod["spec"]["nodeName"]
    assert seen["APP_LABEL"] == "envdump"
    assert seen["FROM_CM"] == "v"
    assert seen["FROM_SECRET"] == "hunter2"
    assert seen["CFG_mode"] == "fast"
    assert seen["CPU_LIMIT"] == "2"
    assert seen["KUBECONFIG"] and seen["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert seen["CUDA_VISIBLE_DEVICES"] == ""
    tmp = Path(seen["TMPDIR"])  # the pod's own, as a container's /tmp, and gone with it
    assert tmp.name == f"liveshard-pod-{pod['metadata']['uid']}" and any(tmp.iterdir())
    kube.kubectl("delete", "pod", "envdump", "--grace-period=0", "--force")
    wait_until(lambda: not tmp.exists(), 30, "the pod's TMPDIR removed with it")


def test_gpu_request_is_scheduled_and_visible(kube: Kube) -> None:
    code = "import os; print('GPUS=' + os.environ['CUDA_VISIBLE_DEVICES'], flush=True)"
    container = {"resources": {"limits": {"nvidia.com/gpu": "2"}}}
    kube.apply(python_pod("gpu", code, container=container, restartPolicy="Never"))
    done = kube.wait_pod("gpu", lambda p: p["status"].get("phase") == "Succeeded", "Succeeded")
    assert "GPUS=0,1" in kube.logs("gpu")
    # A terminated pod's devices are free while the pod is still there (as the scheduler counts
    # them): a pod bound to the same node gets them.
    node = done["spec"]["nodeName"]
    kube.apply(python_pod("again", code, container=container, restartPolicy="Never", nodeName=node))
    kube.wait_pod("again", lambda p: p["status"].get("phase") == "Succeeded", "Succeeded")
    assert "GPUS=0,1" in kube.logs("again")


def test_restart_policies(kube: Kube) -> None:
    kube.apply(python_pod("fails", "raise SystemExit(3)", restartPolicy="Never"))
    kube.apply(python_pod("loops", "print('run', flush=True)", restartPolicy="Always"))
    kube.apply(python_pod("succeeds", "print('done', flush=True)", restartPolicy="OnFailure"))

    failed = kube.wait_pod("fails", lambda p: p["status"].get("phase") == "Failed", "Failed")
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"

    def restarted(p: dict) -> bool:  # type: ignore[type-arg]
        statuses = p["status"].get("containerStatuses") or []
        return bool(statuses) and statuses[0]["restartCount"] >= 2

    looping = kube.wait_pod("loops", restarted, "restarted twice", timeout=60)
    assert looping["status"]["phase"] == "Running"

    done = kube.wait_pod("succeeds", lambda p: p["status"].get("phase") == "Succeeded", "Succeeded")
    assert done["status"]["containerStatuses"][0]["restartCount"] == 0


def test_deployment_pods_run(kube: Kube) -> None:
    kube.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "containers": [
                            {
                                "name": "main",
                                "image": "python",
                                "command": ["python", "-c", "import time; time.sleep(3600)"],
                            }
                        ]
                    },
                },
            },
        }
    )
    kube.kubectl("rollout", "status", "deployment/web", "--timeout=90s", timeout=100)
    pods = kube.pods("app=web")
    assert len([p for p in pods if running(p) and ready(p)]) == 2
    assert len({p["status"]["podIP"] for p in pods}) == 2


SERVE_WHEN_TOLD = """
import http.server, os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
server = http.server.HTTPServer((os.environ["POD_IP"], 8080), http.server.SimpleHTTPRequestHandler)
server.serve_forever()
"""


def test_readiness_and_liveness_probes(kube: Kube, tmp_path: Path) -> None:
    go = tmp_path / "go"
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    container = {
        "command": ["python", "-u", "-c", SERVE_WHEN_TOLD, str(go)],
        "env": [pod_ip],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1},
    }
    kube.apply(python_pod("probed", "", container=container))
    kube.wait_pod("probed", lambda p: running(p) and not ready(p), "Running but not Ready")
    go.touch()
    kube.wait_pod("probed", ready, "Ready once it serves")

    failing = {
        "livenessProbe": {
            "exec": {"command": ["python", "-c", "raise SystemExit(1)"]},
            "periodSeconds": 1,
            "failureThreshold": 1,
        }
    }
    kube.apply(python_pod("unhealthy", "import time; time.sleep(3600)", container=failing))

    def restarted(p: dict) -> bool:  # type: ignore[type-arg]
        statuses = p["status"].get("containerStatuses") or []
        return bool(statuses) and statuses[0]["restartCount"] >= 1

    kube.wait_pod("unhealthy", restarted, "restarted by its liveness probe", timeout=60)
