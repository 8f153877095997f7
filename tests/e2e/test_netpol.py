"""The local cluster's NetworkPolicy enforcement: what policies allow, as a pure function, and
the rules it makes, in the kernel, between real network namespaces (root needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from liveshard_e2e.kubelet import netns, netpol
from liveshard_e2e.kubelet.netpol import Allow, PortRange, Ruleset, Source

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
    workers = (Source("10.1.0.2/32"), Source("10.1.0.3/32"))
    for ip in rules.isolated:
        # The operator's pod of the policy's namespace only; the named port resolved.
        assert Allow(ip, workers, None) in rules.allows
        assert Allow(ip, (Source("10.1.0.4/32"),), (PortRange(TCP, 7070, 7070),)) in rules.allows
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
    assert allow.sources == (Source("10.1.0.5/32"), Source("10.1.0.0/16", ("10.1.0.2/32",)))
    assert allow.ports == (PortRange(17, 8000, 8010),)
    # No ingress rule: isolated, nothing admitted; an Egress-only policy isolates nothing.
    assert allows({"podSelector": {}, "policyTypes": ["Ingress"]}) == Ruleset(
        ("10.1.0.2", "10.1.0.3", "10.1.0.4"), ()
    )
    assert allows({"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]}) == Ruleset((), ())
    # A rule whose peers select no pod admits nothing.
    nobody = {"from": [{"podSelector": {"matchLabels": {"job": "b"}}}]}
    empty = allows({"podSelector": {"matchLabels": {"job": "a"}}, "ingress": [nobody]})
    assert empty.isolated == ("10.1.0.2", "10.1.0.3") and empty.allows == ()
    # Nor does one whose only port is a name the pod has no port of.
    unnamed = allows({"podSelector": {"matchLabels": {"job": "a"}},
                      "ingress": [{"ports": [{"port": "grpc"}]}]})  # fmt: skip
    assert unnamed.isolated == ("10.1.0.2", "10.1.0.3") and unnamed.allows == ()


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
    netns.enable_forwarding()
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


def test_the_kernel_drops_what_the_rules_do_not_admit(
    three: tuple[str, dict[str, netns.PodNetwork]],
) -> None:
    tag, nets = three
    a, b, c = nets["a"], nets["b"], nets["c"]

    def connect(source: netns.PodNetwork, target: netns.PodNetwork, port: int) -> str:
        argv = source.wrap([sys.executable, "-c", CONNECT, target.ip, str(port)])
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()

    servers = [
        subprocess.Popen(net.wrap([sys.executable, "-c", SERVE, "7000", "7002"])) for net in (b, c)
    ]
    try:
        time.sleep(1.0)
        # Before any rule, all is open; each pod answers under its own hostname.
        assert connect(a, b, 7002) == "b"
        # b admits the /24 but a, on ports 7000-7001; a admits no one.
        tables = netpol.Tables(tag)
        block = Source("10.250.0.0/24", (f"{a.ip}/32",))
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
        tables.apply(Ruleset((b.ip,), (Allow(b.ip, (Source(f"{a.ip}/32"),), None),)))
        assert connect(a, b, 7002) == "b"
        assert connect(c, b, 7002) == "unreachable"
    finally:
        for server in servers:
            server.kill()
