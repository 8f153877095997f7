"""The local cluster's NetworkPolicy enforcement: what policies allow, as a pure function, and
the rules it makes, in the kernel, between real network namespaces (root needed)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from liveshard_e2e.kubelet import netns, netpol, noderuntime
from liveshard_e2e.kubelet.config import KubeletConfig, NodeSpec
from liveshard_e2e.kubelet.netpol import Allow, Peer, PortRange, Ruleset
from liveshard_e2e.kubelet.noderuntime import NodeRuntime
from liveshard_e2e.rest import Rest

TCP = 6


def pod(name: str, ip: str, namespace: str = "ns", **labels: str) -> dict[str, Any]:
    ports = [{"name": "agent", "containerPort": 7070}, {"name": "metrics", "containerPort": 9400}]
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "c", "ports": ports}]},
        "status": {"podIP": ip},
    }


def policy(spec: dict[str, Any], namespace: str = "ns") -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": namespace}, "spec": spec}


PODS = [
    pod("w0", "10.1.0.2", job="a"),
    pod("w1", "10.1.0.3", job="a"),
    pod("op", "10.1.0.4", app="operator"),
    pod("other", "10.1.0.5", "elsewhere", app="operator"),
]
NAMESPACES = {"ns": {"team": "x"}, "elsewhere": {"team": "y"}}


def allows(spec: dict[str, Any]) -> Ruleset:
    return netpol.ruleset([policy(spec)], PODS, NAMESPACES)


def test_selected_pods_are_isolated_and_admit_what_the_rules_name() -> None:
    rules = allows({
        "podSelector": {"matchLabels": {"job": "a"}},
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"job": "a"}}}]},
            {"from": [{"podSelector": {"matchExpressions": [
                {"key": "app", "operator": "In", "values": ["operator"]}]}}],
             "ports": [{"port": "agent"}]},
            {"ports": [{"port": 9400, "protocol": "TCP"}]},
        ],
    })  # fmt: skip
    assert rules.isolated == ("10.1.0.2", "10.1.0.3")
    workers = (Peer("10.1.0.2/32"), Peer("10.1.0.3/32"))
    for ip in rules.isolated:
        # The operator's pod of the policy's namespace only; the named port resolved.
        assert Allow(ip, workers, None) in rules.allows
        assert Allow(ip, (Peer("10.1.0.4/32"),), (PortRange(TCP, 7070, 7070),)) in rules.allows
        assert Allow(ip, None, (PortRange(TCP, 9400, 9400),)) in rules.allows
    assert len(rules.allows) == 6


def test_namespace_selectors_blocks_ranges_and_deny_all() -> None:
    rules = allows({
        "podSelector": {"matchLabels": {"app": "operator"}},
        "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "y"}}},
                              {"ipBlock": {"cidr": "10.1.0.0/16", "except": ["10.1.0.2/32"]}}],
                     "ports": [{"port": 8000, "endPort": 8010, "protocol": "UDP"}]}],
    })  # fmt: skip
    # Only the pods of the policy's own namespace are selected.
    assert rules.isolated == ("10.1.0.4",)
    (allow,) = rules.allows
    assert allow.peers == (Peer("10.1.0.5/32"), Peer("10.1.0.0/16", ("10.1.0.2/32",)))
    assert allow.ports == (PortRange(17, 8000, 8010),)
    # No ingress rule: isolated, nothing admitted; an Egress-only policy isolates for egress only.
    assert allows({"podSelector": {}, "policyTypes": ["Ingress"]}) == Ruleset(
        ("10.1.0.2", "10.1.0.3", "10.1.0.4"), ()
    )
    egress_only = {"podSelector": {"matchLabels": {"job": "a"}}, "policyTypes": ["Egress"],
                   "egress": [{}]}  # fmt: skip
    anywhere = (Allow("10.1.0.2", None, None), Allow("10.1.0.3", None, None))
    assert allows(egress_only) == Ruleset((), (), ("10.1.0.2", "10.1.0.3"), anywhere)
    # A rule whose peers select no pod admits nothing.
    nobody = {"from": [{"podSelector": {"matchLabels": {"job": "b"}}}]}
    empty = allows({"podSelector": {"matchLabels": {"job": "a"}}, "ingress": [nobody]})
    assert empty.isolated == ("10.1.0.2", "10.1.0.3") and empty.allows == ()
    # Nor does one whose only port is a name the pod has no port of.
    unnamed = allows({"podSelector": {"matchLabels": {"job": "a"}},
                      "ingress": [{"ports": [{"port": "grpc"}]}]})  # fmt: skip
    assert unnamed.isolated == ("10.1.0.2", "10.1.0.3") and unnamed.allows == ()


def test_egress_rules_admit_peers_and_resolve_named_ports_at_the_pod_connected_to() -> None:
    rules = allows({
        "podSelector": {"matchLabels": {"app": "operator"}},
        "policyTypes": ["Egress"],
        "egress": [
            {"to": [{"podSelector": {"matchLabels": {"job": "a"}}}], "ports": [{"port": "agent"}]},
            {"to": [{"ipBlock": {"cidr": "10.1.0.0/24", "except": ["10.1.0.3/32"]}}],
             "ports": [{"port": 53, "protocol": "UDP"}, {"port": "metrics"}]},
            {"to": [{"namespaceSelector": {"matchLabels": {"team": "z"}}}]},
        ],
    })  # fmt: skip
    # Egress only: the operator's pod is isolated for egress, nothing for ingress.
    assert (rules.isolated, rules.allows, rules.egress_isolated) == ((), (), ("10.1.0.4",))
    agent, metrics = PortRange(TCP, 7070, 7070), PortRange(TCP, 9400, 9400)
    block = (Peer("10.1.0.0/24", ("10.1.0.3/32",)),)
    assert set(rules.egress_allows) == {
        # The named port is each selected pod's own.
        Allow("10.1.0.4", (Peer("10.1.0.2/32"),), (agent,)),
        Allow("10.1.0.4", (Peer("10.1.0.3/32"),), (agent,)),
        # The number to the whole block; the name to the block's pods that name it, the
        # exception and the pods outside the block left out.
        Allow("10.1.0.4", block, (PortRange(17, 53, 53),)),
        Allow("10.1.0.4", (Peer("10.1.0.2/32"),), (metrics,)),
        Allow("10.1.0.4", (Peer("10.1.0.4/32"),), (metrics,)),
        Allow("10.1.0.4", (Peer("10.1.0.5/32"),), (metrics,)),
    }
    # A rule whose peers select nothing (no namespace "z") admits nothing.
    assert len(rules.egress_allows) == 6
    # Both kinds at once: each pod isolated both ways.
    both = allows({"podSelector": {"matchLabels": {"job": "a"}}, "ingress": [{}], "egress": []})
    assert both.isolated == both.egress_isolated == ("10.1.0.2", "10.1.0.3")
    assert both.egress_allows == ()


SERVE = """
import socket, sys, threading, time
for port in map(int, sys.argv[1:]):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
    def serve(s=s):
        while True:
            c, _ = s.accept()
            c.sendall(socket.gethostname().encode())
            c.close()
    threading.Thread(target=serve, daemon=True).start()
time.sleep(120)
"""
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5) as s:
        print(s.recv(100).decode())
except OSError:
    print("unreachable")
"""


@pytest.fixture
def three(tmp_path: Path) -> Iterator[tuple[str, dict[str, netns.PodNetwork]]]:
    if why := netns.unavailable():
        pytest.skip(f"no network namespaces for pods here: {why}")
    tag = f"ls-t{os.getpid():07x}-"
    nets = {}
    try:
        for i, name in enumerate(("a", "b", "c")):
            folder = tmp_path / name
            folder.mkdir()
            nets[name] = netns.PodNetwork(tag, f"{name}{i:011d}", f"10.250.0.{i + 2}", name, folder)
            nets[name].up()
        yield tag, nets
    finally:
        netpol.remove_tables(tag)
        netns.remove_all(tag)
        netns.restore_forwarding()


def connect(source: netns.PodNetwork, target: netns.PodNetwork | str, port: int) -> str:
    """What a connection from ``source`` to ``target`` (a pod or an address) was answered
    with: the server's hostname, or "unreachable"."""
    ip = target if isinstance(target, str) else target.ip
    argv = source.wrap([sys.executable, "-c", CONNECT, ip, str(port)])
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def serving(*wraps: Callable[[list[str]], list[str]], ports: str = "7000 7002") -> Iterator[None]:
    """SERVE on ``ports`` in each namespace ``wraps`` runs a command in."""
    servers = [subprocess.Popen(wrap([sys.executable, "-c", SERVE, *ports.split()]))
               for wrap in wraps]  # fmt: skip
    try:
        time.sleep(1.0)
        yield
    finally:
        for server in servers:
            server.kill()


def test_the_kernel_drops_what_the_rules_do_not_admit(
    three: tuple[str, dict[str, netns.PodNetwork]],
) -> None:
    tag, nets = three
    a, b, c = nets["a"], nets["b"], nets["c"]
    with serving(b.wrap, c.wrap):
        # Before any rule, all is open; each pod answers under its own hostname.
        assert connect(a, b, 7002) == "b"
        # b admits the /24 but a, on ports 7000-7001; a admits no one.
        tables = netpol.Tables(tag)
        block = Peer("10.250.0.0/24", (f"{a.ip}/32",))
        tables.apply(Ruleset((a.ip, b.ip), (Allow(b.ip, (block,), (PortRange(TCP, 7000, 7001),)),)))
        assert connect(c, b, 7000) == "b"
        assert connect(c, b, 7002) == "unreachable"
        assert connect(a, b, 7000) == "unreachable"
        # a, isolated, still opens connections out and gets their answers.
        assert connect(a, c, 7002) == "c"
        # The host always reaches its pods.
        out = subprocess.run([sys.executable, "-c", CONNECT, b.ip, "7002"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == "b"
        # A new ruleset replaces the old: b opens to a.
        tables.apply(Ruleset((b.ip,), (Allow(b.ip, (Peer(f"{a.ip}/32"),), None),)))
        assert connect(a, b, 7002) == "b"
        assert connect(c, b, 7002) == "unreachable"


def test_the_kernel_drops_what_egress_rules_do_not_admit_to_pods_and_to_the_host(
    three: tuple[str, dict[str, netns.PodNetwork]],
) -> None:
    tag, nets = three
    a, b, c = nets["a"], nets["b"], nets["c"]
    with socket.socket() as probe:
        probe.bind(("", 0))
        host_port = probe.getsockname()[1]
    host = socket.gethostname()
    with serving(b.wrap, c.wrap), serving(lambda argv: argv, ports=str(host_port)):
        assert connect(a, netns.GATEWAY, host_port) == host
        # a may open connections to c's port 7000 only; b admits a on 7000 only.
        tables = netpol.Tables(tag)
        to_c = Allow(a.ip, (Peer(f"{c.ip}/32"),), (PortRange(TCP, 7000, 7000),))
        to_b = Allow(a.ip, (Peer(f"{b.ip}/32"),), None)
        from_a = Allow(b.ip, (Peer(f"{a.ip}/32"),), (PortRange(TCP, 7000, 7000),))
        tables.apply(Ruleset((b.ip,), (from_a,), (a.ip,), (to_c, to_b)))
        assert connect(a, c, 7000) == "c"
        assert connect(a, c, 7002) == "unreachable"
        # Both ends must admit a connection: a's egress does, b's ingress only on 7000.
        assert connect(a, b, 7000) == "b"
        assert connect(a, b, 7002) == "unreachable"
        # Egress to the host is held to the rules too; other pods are not held by a's.
        assert connect(a, netns.GATEWAY, host_port) == "unreachable"
        assert connect(c, netns.GATEWAY, host_port) == host
        assert connect(c, b, 7000) == "unreachable" and connect(b, c, 7002) == "c"
        # An address block admits the host.
        to_host = Allow(a.ip, (Peer(f"{netns.GATEWAY}/32"),), None)
        tables.apply(Ruleset((), (), (a.ip,), (to_host,)))
        assert connect(a, netns.GATEWAY, host_port) == host
        assert connect(a, c, 7000) == "unreachable"


WRITE = """
import sys
for path in sys.argv[1:]:
    try:
        open(path, "w").close()
        print(path, "written")
    except OSError as err:
        print(path, err.strerror)
"""


def test_a_read_only_root_leaves_only_the_volumes_mount_paths_writable(
    three: tuple[str, dict[str, netns.PodNetwork]], tmp_path: Path
) -> None:
    a = three[1]["a"]
    volume, elsewhere = tmp_path / "volume", tmp_path / "elsewhere"
    volume.mkdir()
    files = [str(volume / "f"), str(elsewhere), str(tmp_path / "not-mounted" / "g")]

    def written(writable: list[str] | None) -> list[str]:
        argv = a.wrap([sys.executable, "-c", WRITE, *files[:2]], writable)
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        return [line.split(" ", 1)[1] for line in out.splitlines()]

    # A mount path that is no directory here is left out, as every other path.
    assert written([str(volume), files[2]]) == ["written", "Read-only file system"]
    assert not elsewhere.exists() and (volume / "f").exists()
    # The host's root stays writable, and so is a pod's without a read-only root.
    (tmp_path / "host").touch()
    assert written(None) == ["written", "written"]


def test_a_nodes_pod_addresses_are_taken_in_turn_and_reused_once_released() -> None:
    config = KubeletConfig("/run", "", 0, "", 0, "", "", (), ip_block=7, pod_network="netns")
    node = NodeRuntime(config, NodeSpec("n", 3), cast(Rest, None), {})  # no API calls
    first = node.allocate_ip()
    assert first == "10.8.3.2"
    held = [first] + [node.allocate_ip() for _ in range(noderuntime.HOSTS - 1)]
    assert len(set(held)) == noderuntime.HOSTS and held[-1] == "10.8.3.254"
    with pytest.raises(netns.NetworkError, match=r"all 253 pod addresses 10\.8\.3\.\* taken"):
        node.allocate_ip()
    node.release_ip("10.8.3.9")
    assert node.allocate_ip() == "10.8.3.9"
    # Released addresses are given again in turn, not the lowest first.
    node.release_ip("10.8.3.5")
    node.release_ip("10.8.3.4")
    assert node.allocate_ip() == "10.8.3.4" and node.allocate_ip() == "10.8.3.5"


def test_forwarding_is_put_back_once_no_pod_namespace_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forwarding, before, namespaces = tmp_path / "ip_forward", tmp_path / "before", tmp_path / "ns"
    monkeypatch.setattr(netns, "FORWARDING", forwarding)
    monkeypatch.setattr(netns, "FORWARDING_BEFORE", before)
    monkeypatch.setattr(netns, "NETNS_DIR", namespaces)
    forwarding.write_text("0\n")
    namespaces.mkdir()
    (namespaces / "ls-0000000a-pod").touch()
    netns.enable_forwarding()
    netns.enable_forwarding()  # a second pod, or cluster: what it was before stays the first's
    assert forwarding.read_text() == "1\n" and before.read_text() == "0\n"
    netns.restore_forwarding()  # a pod's namespace is left: not yet
    assert forwarding.read_text() == "1\n"
    (namespaces / "ls-0000000a-pod").unlink()
    (namespaces / "other").touch()
    netns.restore_forwarding()
    assert forwarding.read_text() == "0\n" and not before.exists()
