"""helm install and uninstall of a small chart against the local cluster (helm checks the
chart's kubeVersion against the server's stamped version). Needs the local cluster."""

from __future__ import annotations

from pathlib import Path

from liveshard_e2e.testing import Kube, ready, running
from liveshard_e2e.waiting import wait_until

CHART = """apiVersion: v2
name: tiny
version: 0.1.0
kubeVersion: ">=1.30.0-0"
"""

VALUES = """replicas: 1
message: hello from helm
"""

TEMPLATE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-config
data:
  message: {{ .Values.message | quote }}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}
spec:
  replicas: {{ .Values.replicas }}
  selector:
    matchLabels: {app: {{ .Release.Name }}}
  template:
    metadata:
      labels: {app: {{ .Release.Name }}}
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: main
          image: python
          command:
            - python
            - -u
            - -c
            - "import os, time; print(os.environ['MESSAGE']); time.sleep(3600)"
          env:
            - name: MESSAGE
              valueFrom: {configMapKeyRef: {name: {{ .Release.Name }}-config, key: message}}
"""


def test_helm_install_and_uninstall(kube: Kube, tmp_path: Path) -> None:
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(CHART)
    (chart / "values.yaml").write_text(VALUES)
    (chart / "templates" / "all.yaml").write_text(TEMPLATE)
    ns = ["--namespace", kube.namespace]
    kube.run("helm", "install", "demo", str(chart), *ns, "--wait", "--timeout=90s", timeout=120)
    pods = kube.pods("app=demo")
    assert len(pods) == 1 and running(pods[0]) and ready(pods[0])
    name = pods[0]["metadata"]["name"]
    wait_until(lambda: "hello from helm" in kube.logs(name), 30, "the chart's message in the log")
    assert "demo" in kube.run("helm", "list", *ns).stdout

    kube.run("helm", "uninstall", "demo", *ns, "--wait", "--timeout=90s", timeout=120)
    assert kube.get(f"/api/v1/namespaces/{kube.namespace}/configmaps/demo-config") is None
    wait_until(lambda: not kube.pods("app=demo"), 60, "the release's pods to be deleted")
