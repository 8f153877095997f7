"""One local cluster's lifecycle: ``up`` (idempotent), ``down`` and ``status``.

A cluster is named; its state (certificates, kubeconfig, logs, the ids of the processes it
started) lives in ``$LIVESHARD_CACHE/run/<name>`` and etcd's data on tmpfs. Processes are found
again only through the recorded ids in ``state.json``, never by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from liveshard_e2e import controlplane as cp
from liveshard_e2e import procs
from liveshard_e2e.binaries import Binaries, cache_root, find_binaries
from liveshard_e2e.kubelet import netns, netpol
from liveshard_e2e.kubelet.config import KubeletConfig, NodeSpec, pod_tmp
from liveshard_e2e.pki import create_pki, issue_serving_cert
from liveshard_e2e.rest import Rest
from liveshard_e2e.waiting import wait_until

log = logging.getLogger(__name__)

# Stop order: the kubelet first (it ends the pods' processes), etcd last.
_STOP_ORDER = ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


@dataclass(frozen=True)
class ClusterOptions:
    """What ``up`` creates."""

    name: str = "default"
    nodes: int = 2
    gpus_per_node: int = 0
    node_cpu: str = "8"
    node_memory: str = "32Gi"
    # "loopback" (pods on the host's network) or "netns" (a namespace each, policies enforced).
    pod_network: str = "loopback"

    def __post_init__(self) -> None:
        if self.pod_network not in ("loopback", "netns"):
            raise ValueError(f"pod_network {self.pod_network!r} must be 'loopback' or 'netns'")
        if not self.name.replace("-", "").isalnum():
            raise ValueError(f"cluster name {self.name!r} must be letters, digits and '-'")
        if not 1 <= self.nodes <= 250:
            raise ValueError(f"nodes {self.nodes} must be between 1 and 250")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node {self.gpus_per_node} must be >= 0")

    def node_specs(self) -> tuple[NodeSpec, ...]:
        return tuple(
            NodeSpec(
                name=f"node-{i}",
                index=i,
                cpu=self.node_cpu,
                memory=self.node_memory,
                gpus=self.gpus_per_node,
            )
            for i in range(self.nodes)
        )


@dataclass(frozen=True)
class ClusterInfo:
    """A running cluster: what a user or a test needs to talk to it."""

    name: str
    run_dir: Path
    kubeconfig: Path
    server: str
    kubectl: Path
    helm: Path
    nodes: tuple[str, ...]


def run_dir(name: str) -> Path:
    return cache_root() / "run" / name


def _etcd_dir(name: str) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"liveshard-{name}-etcd"
    return run_dir(name) / "etcd"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One up/down at a time per cluster, across processes."""
    root = cache_root() / "run"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _state_path(name: str) -> Path:
    return run_dir(name) / "state.json"


def _read_state(name: str) -> dict[str, object] | None:
    try:
        return dict(json.loads(_state_path(name).read_text()))
    except FileNotFoundError:
        return None


def _write_state(name: str, state: dict[str, object]) -> None:
    path = _state_path(name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


def _records(state: dict[str, object]) -> list[procs.ProcessRecord]:
    raw = state.get("processes") or []
    assert isinstance(raw, list)
    return [procs.ProcessRecord.from_json(r) for r in raw]


def _info(name: str, state: dict[str, object], bins: Binaries) -> ClusterInfo:
    nodes = state["nodes"]
    assert isinstance(nodes, list)
    return ClusterInfo(
        name=name,
        run_dir=run_dir(name),
        kubeconfig=run_dir(name) / "kubeconfig",
        server=str(state["server"]),
        kubectl=bins.kubectl,
        helm=bins.helm,
        nodes=tuple(str(n) for n in nodes),
    )


def _healthy(name: str, state: dict[str, object]) -> bool:
    records = _records(state)
    if {r.name for r in records} != set(_STOP_ORDER):
        return False
    if not all(procs.is_alive(r) for r in records):
        return False
    try:
        Rest(run_dir(name) / "kubeconfig").get_text("/readyz")
    except Exception:
        return False
    return True


def up(options: ClusterOptions | None = None) -> ClusterInfo:
    """Starts the cluster, or returns the running one when it is healthy and has the same
    options. Raises :class:`~liveshard_e2e.binaries.BinariesMissing` when nothing is built."""
    options = options or ClusterOptions()
    bins = find_binaries()
    with _locked(options.name):
        state = _read_state(options.name)
        if state is not None:
            if state.get("options") == _options_json(options) and _healthy(options.name, state):
                return _info(options.name, state, bins)
            log.info("cluster %s: not healthy or other options; restarting it", options.name)
            _down_locked(options.name)
        try:
            return _start(options, bins)
        except BaseException:
            log.error("cluster %s failed to start; stopping what was started", options.name)
            _down_locked(options.name)
            raise


def _options_json(options: ClusterOptions) -> dict[str, object]:
    return {
        "nodes": options.nodes,
        "gpus_per_node": options.gpus_per_node,
        "node_cpu": options.node_cpu,
        "node_memory": options.node_memory,
        "pod_network": options.pod_network,
    }


def _start(options: ClusterOptions, bins: Binaries) -> ClusterInfo:
    t0 = time.monotonic()
    name = options.name
    if options.pod_network == "netns" and (why := netns.unavailable()):
        raise RuntimeError(f"cluster {name}: no pod network of namespaces here: {why}")
    root = run_dir(name)
    shutil.rmtree(root, ignore_errors=True)
    (root / "logs").mkdir(parents=True)
    etcd_data = _etcd_dir(name)
    shutil.rmtree(etcd_data, ignore_errors=True)
    pki = create_pki(root / "pki")
    ports = cp.Ports(procs.free_port(), procs.free_port(), procs.free_port())
    server = f"https://127.0.0.1:{ports.apiserver}"
    kubeconfig = root / "kubeconfig"
    nodes = options.node_specs()
    state: dict[str, object] = {
        "options": _options_json(options),
        "server": server,
        "etcd_data": str(etcd_data),
        "nodes": [n.name for n in nodes],
        "processes": [],
        "binaries": str(bins.folder),
    }
    records: list[dict[str, object]] = []
    state["processes"] = records
    _write_state(name, state)

    def launch(
        proc_name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> procs.ProcessRecord:
        _, record = procs.start(proc_name, argv, root / "logs" / f"{proc_name}.log", env=env)
        records.append(record.to_json())
        _write_state(name, state)
        return record

    etcd = launch("etcd", cp.etcd_argv(bins, etcd_data, ports))
    cp.wait_http_ok(
        "etcd",
        f"http://127.0.0.1:{ports.etcd_client}/health",
        None,
        lambda: procs.is_alive(etcd),
        Path(etcd.log_file),
    )
    apiserver = launch(
        "kube-apiserver",
        # Pods in namespaces of their own reach it at the gateway address (netns.GATEWAY).
        cp.apiserver_argv(bins, pki, ports, root / "pki" / "generated",
                          bind="0.0.0.0" if options.pod_network == "netns" else "127.0.0.1"),
    )  # fmt: skip
    cp.wait_http_ok(
        "kube-apiserver",
        f"{server}/readyz",
        pki.ca.cert,
        lambda: procs.is_alive(apiserver),
        Path(apiserver.log_file),
    )
    admin = {"client-certificate": str(pki.admin.cert), "client-key": str(pki.admin.key)}
    cp.write_kubeconfig(kubeconfig, server, pki.ca.cert, admin)
    log.info("cluster %s: API server ready after %.1f s", name, time.monotonic() - t0)

    launch("kube-controller-manager", cp.controller_manager_argv(bins, pki, kubeconfig))
    launch("kube-scheduler", cp.scheduler_argv(bins, kubeconfig))

    log_port = procs.free_port()
    log_pair = issue_serving_cert(pki, root / "pki", "kubelet-serving", ["127.0.0.1"])
    kconfig = KubeletConfig(
        run_dir=str(root),
        kubeconfig=str(kubeconfig),
        apiserver_port=ports.apiserver,
        ca_file=str(pki.ca.cert),
        log_port=log_port,
        log_cert=str(log_pair.cert),
        log_key=str(log_pair.key),
        nodes=nodes,
        ip_block=zlib.crc32(name.encode()) % 200,
        pod_network=options.pod_network,
    )
    config_file = kconfig.save()
    env = dict(os.environ)
    # Pods run `python` as this interpreter (the project's venv), as an image would ship one.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    kubelet = launch(
        "kubelet", [sys.executable, "-m", "liveshard_e2e.kubelet", str(config_file)], env
    )

    rest = Rest(kubeconfig)

    def nodes_ready() -> bool:
        if not procs.is_alive(kubelet):
            raise RuntimeError(
                f"the kubelet exited; {kubelet.log_file}:\n{procs.tail(kubelet.log_file)}"
            )
        items = rest.get("/api/v1/nodes", labelSelector="liveshard.dev/process-kubelet=true")[
            "items"
        ]
        ready = [
            n
            for n in items
            if not any(
                t["key"] == "node.kubernetes.io/not-ready" for t in n["spec"].get("taints") or []
            )
            and any(
                c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"]
            )
        ]
        return len(ready) == len(nodes)

    wait_until(nodes_ready, 90, f"{len(nodes)} nodes Ready without the not-ready taint")
    wait_until(
        lambda: rest.get("/api/v1/namespaces/default/serviceaccounts/default"),
        60,
        "the controller manager to create the default ServiceAccount",
    )
    log.info("cluster %s: up in %.1f s", name, time.monotonic() - t0)
    return _info(name, state, bins)


def down(name: str = "default") -> bool:
    """Stops everything the cluster started, by recorded ids; False when nothing was running."""
    with _locked(name):
        return _down_locked(name)


def _down_locked(name: str) -> bool:
    state = _read_state(name)
    if state is None:
        return False
    by_name = {r.name: r for r in _records(state)}
    for proc_name in _STOP_ORDER:
        record = by_name.get(proc_name)
        if record is not None:
            procs.stop(record, grace_seconds=10)
    _kill_pod_groups(run_dir(name) / "kubelet" / "pids")
    for pod in (run_dir(name) / "kubelet" / "pods").glob("*_*_*"):  # `pod_dir`: ns_name_uid
        shutil.rmtree(pod_tmp(pod.name.rpartition("_")[2]), ignore_errors=True)
    options = state.get("options")
    if isinstance(options, dict) and options.get("pod_network") == "netns":
        # What a kubelet that died left of its pods' namespaces and its policies' tables.
        tag = netns.cluster_tag(str(run_dir(name)))
        netns.remove_all(tag)
        netns.restore_forwarding()
        netpol.remove_tables(tag)
    etcd_data = state.get("etcd_data")
    if etcd_data:
        shutil.rmtree(str(etcd_data), ignore_errors=True)
    _state_path(name).unlink(missing_ok=True)
    log.info("cluster %s: down", name)
    return True


def _kill_pod_groups(pids_dir: Path) -> None:
    """Pod process groups the kubelet recorded and did not end (it may have died)."""
    if not pids_dir.is_dir():
        return
    for entry in pids_dir.iterdir():
        with contextlib.suppress(ValueError, OSError):
            record = procs.ProcessRecord(
                f"pod process {entry.name}", int(entry.name), int(entry.read_text().strip()), ""
            )
            procs.stop(record, grace_seconds=2)
        entry.unlink(missing_ok=True)


@dataclass(frozen=True)
class ClusterStatus:
    """What ``status`` reports."""

    name: str
    running: bool
    processes: dict[str, bool]
    info: ClusterInfo | None


def status(name: str = "default") -> ClusterStatus:
    state = _read_state(name)
    if state is None:
        return ClusterStatus(name, False, {}, None)
    alive = {r.name: procs.is_alive(r) for r in _records(state)}
    healthy = _healthy(name, state)
    info = _info(name, state, find_binaries()) if healthy else None
    return ClusterStatus(name, healthy, alive, info)
