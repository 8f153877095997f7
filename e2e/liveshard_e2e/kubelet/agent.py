"""The kubelet process: registers the nodes, watches the pods bound to them and keeps one
:class:`~liveshard_e2e.kubelet.pods.PodWorker` per pod; on SIGTERM it ends every pod's processes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from liveshard_e2e.controlplane import HEARTBEAT_SECONDS
from liveshard_e2e.kubelet import netns
from liveshard_e2e.kubelet.config import KubeletConfig
from liveshard_e2e.kubelet.logserver import LogServer
from liveshard_e2e.kubelet.netpol import Enforcer
from liveshard_e2e.kubelet.noderuntime import NodeRuntime
from liveshard_e2e.kubelet.nodes import NodeAgent
from liveshard_e2e.kubelet.pods import PodWorker
from liveshard_e2e.rest import ApiError, Rest

log = logging.getLogger(__name__)


class Kubelet:
    """All nodes of one cluster in one process."""

    def __init__(self, config: KubeletConfig) -> None:
        self.config = config
        self.rest = Rest(config.kubeconfig, pool_size=64)
        self.nodes_agent = NodeAgent(config, self.rest, HEARTBEAT_SECONDS)
        base_env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            **config.api_env("127.0.0.1"),
        }
        self.runtimes = {
            spec.name: NodeRuntime(config, spec, self.rest, base_env) for spec in config.nodes
        }
        self.workers: dict[str, PodWorker] = {}
        self._stop = threading.Event()
        self.tag = netns.cluster_tag(config.run_dir)
        self.policies = Enforcer(self.rest, self.tag) if config.pod_network == "netns" else None

    def run(self) -> None:
        if self.policies is not None:
            netns.remove_all(self.tag)
            self.policies.start()
        self.nodes_agent.register()
        self.nodes_agent.start()
        logs = LogServer(
            self.config.log_port,
            self.config.log_cert,
            self.config.log_key,
            self.config.state_dir / "pods",
        )
        logs.start()
        (self.config.state_dir / "ready").write_text(f"{os.getpid()}\n")
        log.info("kubelet ready with nodes %s", ", ".join(self.runtimes))
        while not self._stop.is_set():
            try:
                self._list_and_watch()
            except ApiError as err:
                if err.status != 410:
                    log.warning("pod watch failed: %s", err)
                    self._stop.wait(1)
            except Exception:
                log.exception("pod watch failed")
                self._stop.wait(1)
        logs.shutdown()

    def _ours(self, pod: dict[str, Any]) -> bool:
        return pod.get("spec", {}).get("nodeName") in self.runtimes

    def _list_and_watch(self) -> None:
        listing = self.rest.get("/api/v1/pods")
        seen = set()
        for pod in listing["items"]:
            if self._ours(pod):
                seen.add(pod["metadata"]["uid"])
                self._apply("ADDED", pod)
        for uid in [u for u in self.workers if u not in seen]:
            self._apply_gone(uid)
        version = listing["metadata"]["resourceVersion"]
        for event in self.rest.watch("/api/v1/pods", version):
            if self._stop.is_set():
                return
            if event["type"] == "BOOKMARK":
                continue
            pod = event["object"]
            if self._ours(pod):
                self._apply(event["type"], pod)

    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self._apply_gone(uid)
            return
        worker = self.workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        phase = pod.get("status", {}).get("phase", "Pending")
        if phase in ("Succeeded", "Failed"):
            return
        if phase == "Running":
            # Ran under an earlier kubelet process whose containers are gone.
            self._fail_orphan(pod)
            return
        worker = PodWorker(self.runtimes[pod["spec"]["nodeName"]], pod)
        self.workers[uid] = worker
        worker.start()
        self._reap_workers()

    def _apply_gone(self, uid: str) -> None:
        worker = self.workers.pop(uid, None)
        if worker is not None:
            worker.deleted()

    def _reap_workers(self) -> None:
        for uid in [u for u, w in self.workers.items() if not w.alive]:
            del self.workers[uid]

    def _fail_orphan(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        try:
            if meta.get("deletionTimestamp"):
                self.rest.delete(
                    path, {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
                )
            else:
                body = {
                    "metadata": {"uid": meta["uid"]},
                    "status": {
                        "phase": "Failed",
                        "reason": "KubeletRestarted",
                        "message": "the process kubelet restarted; its processes are gone",
                    },
                }
                self.rest.patch(f"{path}/status", body)
        except ApiError as err:
            log.warning(
                "pod %s/%s: could not fail orphan: %s", meta["namespace"], meta["name"], err
            )

    def shutdown(self) -> None:
        """Stops watching and kills every pod's process groups (a cluster going down has no use
        for graceful container stops; pod deletion is where grace periods are honoured)."""
        self._stop.set()
        self.nodes_agent.stop()
        workers = list(self.workers.values())
        for w in workers:
            w.deleted()
        for w in workers:
            w.join(5)
        if self.policies is not None:
            self.policies.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m liveshard_e2e.kubelet <config.json>``"""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m liveshard_e2e.kubelet <run>/kubelet/config.json")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kubelet = Kubelet(KubeletConfig.load(Path(args[0])))

    def on_term(signum: int, frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        kubelet.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    kubelet.run()
