"""Helpers for tests that run against a local cluster: kubectl and helm with the cluster's
kubeconfig, admin REST access, and bounded waits on objects. Used by ``tests/e2e`` fixtures and
meant for any other end-to-end test (the operator's)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from liveshard_e2e.cluster import ClusterInfo
from liveshard_e2e.kubelet.config import set_heartbeat
from liveshard_e2e.rest import ApiError, Rest
from liveshard_e2e.waiting import wait_until


@dataclass(frozen=True)
class Kube:
    """One cluster as a test sees it; ``namespace`` is the default for namespaced calls."""

    info: ClusterInfo
    namespace: str = "default"
    rest: Rest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rest", Rest(self.info.kubeconfig))

    def in_namespace(self, namespace: str) -> Kube:
        return Kube(self.info, namespace)

    def create_namespace(self, namespace: str, timeout: float = 60) -> Kube:
        """Creates ``namespace`` and waits for its ``default`` ServiceAccount (pods are refused
        by ServiceAccount admission until the controller manager has created it)."""
        self.rest.post("/api/v1/namespaces", {"metadata": {"name": namespace}})
        wait_until(
            lambda: self.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default"),
            timeout,
            f"the default ServiceAccount of namespace {namespace}",
        )
        return self.in_namespace(namespace)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.info.kubeconfig)
        return env

    def run(
        self,
        tool: str,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl or helm (``tool``) on the cluster; raises with its output on failure."""
        binary = {"kubectl": self.info.kubectl, "helm": self.info.helm}[tool]
        result = subprocess.run(
            [str(binary), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed with {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.run(
            "kubectl", "-n", self.namespace, *args, input=input, check=check, timeout=timeout
        )

    def apply(self, manifest: str | dict[str, Any] | list[dict[str, Any]]) -> None:
        if isinstance(manifest, dict):
            text = yaml.safe_dump(manifest)
        elif isinstance(manifest, list):
            text = yaml.safe_dump_all(manifest)
        else:
            text = manifest
        self.kubectl("apply", "-f", "-", input=text)

    def get(self, path: str) -> dict[str, Any] | None:
        """GET an API path; None on 404."""
        try:
            return dict(self.rest.get(path))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/api/v1/namespaces/{self.namespace}/pods/{name}")

    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        query = {"labelSelector": selector} if selector else {}
        return list(self.rest.get(f"/api/v1/namespaces/{self.namespace}/pods", **query)["items"])

    def wait_pod(
        self, name: str, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60
    ) -> dict[str, Any]:
        """Waits until pod ``name`` exists and ``check(pod)`` holds."""

        def satisfied() -> dict[str, Any] | None:
            pod = self.pod(name)
            return pod if pod is not None and check(pod) else None

        return wait_until(
            satisfied,
            timeout,
            f"pod {self.namespace}/{name}: {what}",
            describe=lambda: json.dumps((self.pod(name) or {}).get("status"))[:1500],
        )

    def wait_pod_gone(self, name: str, timeout: float = 60) -> None:
        wait_until(
            lambda: self.pod(name) is None,
            timeout,
            f"pod {self.namespace}/{name} gone",
            describe=lambda: json.dumps((self.pod(name) or {}).get("status"))[:1500],
        )

    def logs(self, pod: str, container: str | None = None) -> str:
        args = ["logs", pod] + (["-c", container] if container else [])
        return self.kubectl(*args).stdout

    def set_heartbeat(self, node: str, enabled: bool) -> None:
        set_heartbeat(self.info.run_dir, node, enabled)


def member_pids(supervisor: int) -> dict[str, int]:
    """The live member processes of a pod of several members, by member: the children of its
    supervisor `supervisor`, named by their command lines (`--member NAME`; a zombie's is empty).
    """
    found = {}
    for pid in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split():
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except FileNotFoundError:
            continue
        if "--member" in words:
            last = max(i for i, word in enumerate(words) if word == "--member")
            found[words[last + 1]] = int(pid)
    return found


def member_pid(pod: dict[str, Any], member: str) -> int:
    """The process of `member` in a pod of several members on the local cluster (its
    supervisor is the container's process, `process://PID`)."""
    supervisor = int(
        pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://")
    )
    pids = member_pids(supervisor)
    if member not in pids:
        raise LookupError(f"no process of {member} under the supervisor {supervisor}")
    return pids[member]


def running(pod: dict[str, Any]) -> bool:
    return bool(pod.get("status", {}).get("phase") == "Running")


def ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def python_pod(name: str, code: str, **spec: Any) -> dict[str, Any]:
    """A pod whose one container runs ``python -c code`` (the kubelet's interpreter)."""
    container = {"name": "main", "image": "python", "command": ["python", "-u", "-c", code]}
    container.update(spec.pop("container", {}))
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": spec.pop("labels", {"app": name})},
        "spec": {"containers": [container], **spec},
    }
    return body
