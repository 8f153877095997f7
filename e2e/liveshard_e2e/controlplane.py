"""The control-plane processes: their command lines, readiness checks and the admin kubeconfig.

It owns the flags of etcd, kube-apiserver, kube-controller-manager and kube-scheduler (and why
each non-default one is there); :mod:`liveshard_e2e.cluster` decides when to start and stop them.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from liveshard_e2e.binaries import Binaries
from liveshard_e2e.pki import Pki
from liveshard_e2e.procs import tail

# Every controller the e2e suite and the operator rely on (names from
# cmd/kube-controller-manager/names). Not listed: cloud, volume, certificate and legacy ones, and
# the endpointslice controller: EndpointSlice validation rejects the loopback pod IPs, so it
# would only retry failing writes (Services have no endpoints here).
CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "disruption-controller",
    "taint-eviction-controller",
    "node-lifecycle-controller",
    "pod-garbage-collector-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "ttl-after-finished-controller",
    "resourcequota-controller",
)

# The process kubelet renews node leases every HEARTBEAT_SECONDS; the node-lifecycle controller
# declares a node NotReady NODE_MONITOR_GRACE seconds after its last renewal (default 50 s).
HEARTBEAT_SECONDS = 2
NODE_MONITOR_GRACE = "12s"


@dataclass(frozen=True)
class Ports:
    """The loopback ports of one cluster."""

    etcd_client: int
    etcd_peer: int
    apiserver: int


def etcd_argv(bins: Binaries, data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(bins.etcd),
        "--name=liveshard",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=liveshard={peer}",
        "--listen-metrics-urls=",
        "--logger=zap",
        "--log-level=warn",
        # A throwaway tmpfs store: durability buys nothing and fsync costs seconds per test.
        "--unsafe-no-fsync",
    ]


def apiserver_argv(
    bins: Binaries, pki: Pki, ports: Ports, cert_dir: Path, bind: str = "127.0.0.1"
) -> list[str]:
    return [
        str(bins.kube_apiserver),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        f"--bind-address={bind}",
        f"--secure-port={ports.apiserver}",
        # On loopback the lease endpoint reconciler rejects the address; 'none' keeps the
        # 'kubernetes' Service without endpoints (nothing here dials it by ClusterIP).
        "--advertise-address=127.0.0.1",
        "--endpoint-reconciler-type=none",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--cert-dir={cert_dir}",
        f"--client-ca-file={pki.ca.cert}",
        f"--service-account-issuer=https://127.0.0.1:{ports.apiserver}",
        f"--service-account-key-file={pki.sa_public}",
        f"--service-account-signing-key-file={pki.sa_private}",
        "--service-cluster-ip-range=10.0.0.0/24",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        # All default admission plugins stay on. ServiceAccount admission (unlike envtest, which
        # disables it) sets spec.serviceAccountName, which a pod-bound TokenRequest requires; as
        # on any cluster, a pod created before the namespace's 'default' account exists is
        # refused, so create pods after the account appears (the test fixtures wait for it).
        # kubectl logs: the apiserver dials the node's InternalIP and kubelet port (the process
        # kubelet's log server) with this client cert.
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-client-certificate={pki.apiserver_kubelet_client.cert}",
        f"--kubelet-client-key={pki.apiserver_kubelet_client.key}",
        f"--kubelet-certificate-authority={pki.ca.cert}",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(bins: Binaries, pki: Pki, kubeconfig: Path) -> list[str]:
    return [
        str(bins.kube_controller_manager),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--secure-port=0",
        f"--controllers={','.join(CONTROLLERS)}",
        f"--root-ca-file={pki.ca.cert}",
        f"--service-account-private-key-file={pki.sa_private}",
        "--use-service-account-credentials=false",
        # Fast node-failure detection for tests (defaults: 5 s and 50 s).
        "--node-monitor-period=2s",
        f"--node-monitor-grace-period={NODE_MONITOR_GRACE}",
        # Garbage collection and namespace deletion react quickly on a small cluster.
        "--concurrent-gc-syncs=5",
        "--namespace-sync-period=10s",
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(bins: Binaries, kubeconfig: Path) -> list[str]:
    return [
        str(bins.kube_scheduler),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--secure-port=0",
        "--profiling=false",
        "--v=1",
    ]


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict[str, str]) -> None:
    """A kubeconfig with absolute paths (JSON is valid YAML); ``user`` holds the credentials."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "liveshard", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "liveshard", "context": {"cluster": "liveshard", "user": "user"}}],
        "current-context": "liveshard",
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


def _get(url: str, ca: Path | None) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err)


def wait_http_ok(
    what: str,
    url: str,
    ca: Path | None,
    alive: Callable[[], bool],
    log_file: Path,
    timeout: float = 120.0,
) -> None:
    """Polls ``url`` until it answers 200, failing early if the process died."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        status, body = _get(url, ca)
        if status == 200:
            return
        last = f"HTTP {status}: {body[:300]}"
        if not alive():
            raise RuntimeError(f"{what} exited while starting; {log_file}:\n{tail(log_file)}")
        time.sleep(0.25)
    raise TimeoutError(
        f"{what} not ready at {url} after {timeout:.0f} s (last: {last}); "
        f"{log_file}:\n{tail(log_file)}"
    )
