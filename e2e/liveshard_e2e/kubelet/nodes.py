"""Fake Node objects: registration with capacity, and heartbeats (lease renewal plus the Ready
condition) that a test can switch off per node."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Any

from liveshard_e2e.kubelet.config import KubeletConfig, NodeSpec, heartbeat_switch
from liveshard_e2e.rest import MERGE, ApiError, Rest

log = logging.getLogger(__name__)

LEASE_SECONDS = 40
STATUS_EVERY = 5  # a status heartbeat every this many lease renewals (as kubelet: 10 s vs 2 s)
KUBELET_VERSION = "v1.34.10-liveshard"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _conditions(transition: bool) -> list[dict[str, str]]:
    """Healthy node conditions; ``lastTransitionTime`` only when they (may) have just changed,
    so a strategic-merge patch keeps the recorded transition time otherwise."""
    now = _now()
    kinds = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID"),
        ("Ready", "True", "KubeletReady"),
    ]
    conds = []
    for kind, status, reason in kinds:
        cond = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": reason,
            "lastHeartbeatTime": now,
        }
        if transition:
            cond["lastTransitionTime"] = now
        conds.append(cond)
    return conds


def _node_status(spec: NodeSpec, log_port: int) -> dict[str, Any]:
    return {
        "capacity": spec.capacity(),
        "allocatable": spec.capacity(),
        "conditions": _conditions(transition=True),
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": spec.name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": log_port}},
        "nodeInfo": {
            "machineID": spec.name,
            "systemUUID": spec.name,
            "bootID": spec.name,
            "kernelVersion": "",
            "osImage": "liveshard process kubelet",
            "containerRuntimeVersion": "process://0",
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


class NodeAgent:
    """Registers the configured nodes and keeps them alive from one background thread."""

    def __init__(self, config: KubeletConfig, rest: Rest, period: float) -> None:
        self._config = config
        self._rest = rest
        self._period = period
        self._stop = threading.Event()
        self._uids: dict[str, str] = {}
        self._paused: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="node-heartbeats", daemon=True)

    def register(self) -> None:
        """Creates (or adopts) every node and reports it Ready; idempotent."""
        for spec in self._config.nodes:
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": spec.name,
                    "labels": {
                        "kubernetes.io/hostname": spec.name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "liveshard.dev/process-kubelet": "true",
                    },
                },
                "spec": {"providerID": f"liveshard://{spec.name}"},
            }
            try:
                node = self._rest.post("/api/v1/nodes", body)
                log.info("registered node %s", spec.name)
            except ApiError as err:
                if err.status != 409:
                    raise
                node = self._rest.get(f"/api/v1/nodes/{spec.name}")
            self._uids[spec.name] = node["metadata"]["uid"]
            status = _node_status(spec, self._config.log_port)
            self._rest.patch(f"/api/v1/nodes/{spec.name}/status", {"status": status})
            self._renew_lease(spec)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _renew_lease(self, spec: NodeSpec) -> None:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": spec.name,
                "namespace": "kube-node-lease",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": spec.name,
                        "uid": self._uids[spec.name],
                    }
                ],
            },
            "spec": {
                "holderIdentity": spec.name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": _micro_now(),
            },
        }
        leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        try:
            self._rest.patch(f"{leases}/{spec.name}", body, content_type=MERGE)
        except ApiError as err:
            if err.status != 404:
                raise
            self._rest.post(leases, body)

    def _post_ready(self, spec: NodeSpec, transition: bool) -> None:
        body = {"status": {"conditions": _conditions(transition)}}
        self._rest.patch(f"/api/v1/nodes/{spec.name}/status", body)

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self._period):
            tick += 1
            for spec in self._config.nodes:
                paused = heartbeat_switch(self._config.run_dir, spec.name).exists()
                if paused:
                    if spec.name not in self._paused:
                        log.warning("node %s: heartbeats stopped (switch file present)", spec.name)
                    self._paused.add(spec.name)
                    continue
                resumed = spec.name in self._paused
                self._paused.discard(spec.name)
                try:
                    self._renew_lease(spec)
                    if resumed or tick % STATUS_EVERY == 0:
                        self._post_ready(spec, transition=resumed)
                except Exception:
                    log.exception("node %s: heartbeat failed", spec.name)
