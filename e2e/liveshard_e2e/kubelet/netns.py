"""Pods in network namespaces of their own (a cluster's ``pod_network="netns"``), routed
through the host, as a routed network plugin wires them.

A pod not on the host's network gets a namespace whose ``eth0``, one end of a veth pair, holds
the pod's IP (a /32) and routes everything through :data:`GATEWAY`, an address every host end
holds; the host routes each pod IP to its pod's end and forwards between them. Traffic between
pods so crosses the host's forward path, where the cluster's NetworkPolicies are enforced
(:mod:`liveshard_e2e.kubelet.netpol`); the host itself (probes, tests) always reaches its pods,
as Kubernetes wants of a node. A container runs in its pod's namespace under a hostname of its
own, the pod's name, which its ``/etc/hosts`` maps to the pod IP, as a kubelet's does: libraries
that bind to the host name's address (gloo) bind to the pod's. A container whose
``securityContext.readOnlyRootFilesystem`` is set sees the root filesystem read-only, in a mount
namespace of its own, but for its volumes' mount paths (volumes are otherwise not mounted: such
a path stays the host's directory, writable).

Needs root and the ``ip``, ``nsenter``, ``unshare`` and ``mount`` tools (iproute2, util-linux).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shlex
import shutil
import subprocess
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from pyroute2.nftables.main import NFTables

GATEWAY = "169.254.1.1"  # on every pod's host end; the pods' route out and the API server's
NETNS_DIR = Path("/run/netns")
FORWARDING = Path("/proc/sys/net/ipv4/ip_forward")
FORWARDING_BEFORE = Path("/run/liveshard-ip-forward")  # its value before the first pod's


class NetworkError(RuntimeError):
    """A pod's namespace could not be made (no root, a tool or a kernel feature missing)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")


def cluster_tag(run_dir: str) -> str:
    """The prefix of a cluster's namespaces' names (``ls-<tag>-``), so that ``down`` finds
    them and clusters side by side never share one."""
    return f"ls-{zlib.crc32(run_dir.encode()):08x}-"


@functools.cache
def unavailable() -> str:
    """Why pods cannot have namespaces of their own here ("": they can): not root, a tool
    missing, or a kernel without network namespaces, veth pairs or nf_tables (found out once
    per process)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "nsenter", "unshare", "mount") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    probe = PodNetwork(f"ls-probe{os.getpid()}-", "0" * 12, "", "", Path())
    try:
        probe.pair()
        with NFTables(nfgen_family=1) as nft:  # inet
            nft.get_tables()
    except (NetworkError, OSError) as err:
        return str(err)
    finally:
        probe.down()
    return ""


@contextlib.contextmanager
def _forwarding() -> Iterator[None]:
    """Held while a pod's namespace is made and forwarding turned on, and while forwarding is
    put back, by every cluster of this host: a namespace made meanwhile is never left without."""
    FORWARDING_BEFORE.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{FORWARDING_BEFORE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def enable_forwarding() -> None:
    """The host forwards between pods (the routed network's one host-wide switch). The first
    to turn it on keeps what it was in :data:`FORWARDING_BEFORE`, for :func:`restore_forwarding`."""
    try:
        if not FORWARDING_BEFORE.exists():
            FORWARDING_BEFORE.write_text(FORWARDING.read_text())
        FORWARDING.write_text("1\n")
    except OSError as err:
        raise NetworkError(f"cannot enable IPv4 forwarding (root needed): {err}") from err


def restore_forwarding() -> None:
    """The host's forwarding as it was before pods had namespaces, once none has (of any
    cluster: each pod turns it on again as it makes its namespace)."""
    with _forwarding():
        pods = NETNS_DIR.is_dir() and any(e.name.startswith("ls-") for e in NETNS_DIR.iterdir())
        if FORWARDING_BEFORE.exists() and not pods:
            with contextlib.suppress(OSError):
                FORWARDING.write_text(FORWARDING_BEFORE.read_text())
                FORWARDING_BEFORE.unlink()


class PodNetwork:
    """One pod's namespace, its veth pair and its routes."""

    def __init__(self, tag: str, uid: str, ip: str, hostname: str, folder: Path) -> None:
        self.namespace = f"{tag}{uid[:12]}"
        self.host_end = _host_end(self.namespace)
        self.ip = ip
        self.hostname = hostname
        self.hosts_file = folder / "etc-hosts"

    def up(self) -> None:
        """Makes the namespace and wires it; what a half-made one left is removed first."""
        self.down()
        self.hosts_file.write_text(f"127.0.0.1 localhost\n{self.ip} {self.hostname}\n")
        with _forwarding():  # the namespace is there for `restore_forwarding` to see
            self.pair()
            enable_forwarding()
        _ip("addr", "add", f"{GATEWAY}/32", "dev", self.host_end)
        _ip("link", "set", self.host_end, "up")
        _ip("route", "add", f"{self.ip}/32", "dev", self.host_end)
        inside = ("-n", self.namespace)
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", f"{self.ip}/32", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "route", "add", GATEWAY, "dev", "eth0", "scope", "link")
        _ip(*inside, "route", "add", "default", "via", GATEWAY, "dev", "eth0")

    def pair(self) -> None:
        """The namespace and its veth pair, ``eth0`` inside."""
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.host_end, "type", "veth", "peer", "name", "eth0",
            "netns", self.namespace)  # fmt: skip

    def down(self) -> None:
        """Removes the namespace; its veth pair and the host's route to it go with it."""
        remove(self.namespace)

    def wrap(self, argv: list[str], writable: Sequence[str] | None = None) -> list[str]:
        """``argv`` run in the pod's namespace with the pod's hostname and ``/etc/hosts`` (the
        same process: each tool execs the next). With ``writable`` (a container's
        ``readOnlyRootFilesystem``), the root filesystem is read-only there but for those
        directories (its volumes' mount paths that exist here), which stay the host's."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2'
        if writable is not None:
            for path in (p for p in writable if os.path.isdir(p)):
                script += f" && mount --bind {shlex.quote(path)} {shlex.quote(path)}"
            script += " && mount -o remount,bind,ro /"
        return [
            "nsenter", f"--net={NETNS_DIR / self.namespace}", "--",
            "unshare", "--uts", "--mount", "--propagation", "private", "--",
            "sh", "-c", f'{script} && exec "$@"', "sh", self.hostname, str(self.hosts_file), *argv,
        ]  # fmt: skip


def _host_end(namespace: str) -> str:
    return f"lsv{zlib.crc32(namespace.encode()):08x}"  # interface names hold 15 bytes


def remove(namespace: str) -> None:
    """A pod's namespace and its veth pair. The pair is deleted first, by its host end, which
    takes both ends at once: the kernel frees a deleted namespace's interfaces later, and a
    pair of the same name made meanwhile would be refused."""
    with contextlib.suppress(NetworkError):
        if (Path("/sys/class/net") / _host_end(namespace)).exists():
            _ip("link", "del", _host_end(namespace))
        if (NETNS_DIR / namespace).exists():
            _ip("netns", "del", namespace)


def remove_all(tag: str) -> None:
    """Every namespace a cluster's pods left (its kubelet may have died)."""
    if NETNS_DIR.is_dir():
        for entry in NETNS_DIR.iterdir():
            if entry.name.startswith(tag):
                remove(entry.name)
