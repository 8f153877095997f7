"""The NetworkPolicies of a cluster whose pods have network namespaces, enforced in the host's
kernel with nftables, as a network plugin's policy agent enforces them.

Every half second the enforcer lists the policies, pods and namespaces; when what they allow
changed, it writes a new table and then removes the old one (two tables both apply in between,
so a change never opens more than either allows). The table's ``forward`` chain sees traffic
between pods (:mod:`liveshard_e2e.kubelet.netns`): it accepts packets of connections already
admitted, then for each pod that an Ingress policy selects the connections some rule of those
policies admits (source pods, namespaces or address blocks with their exceptions; ports, named
ports and port ranges), and drops the rest. A pod no policy selects is open. Traffic from the
host (probes, tests) is never filtered, as Kubernetes wants of a node. Egress rules are not
enforced: a policy's egress is logged once and ignored.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyroute2.nftables.main import NFTables

from liveshard_e2e.rest import ApiError, Rest

log = logging.getLogger(__name__)

PERIOD = 0.5
PROTOCOLS = {"TCP": 6, "UDP": 17, "SCTP": 132}
NF_DROP, NF_ACCEPT, NFT_JUMP, NFT_RETURN = 0, 1, -3, -5
CT_ESTABLISHED_OR_RELATED = 2 | 4


@dataclass(frozen=True)
class Source:
    """An address block a connection may come from, less its exceptions."""

    cidr: str
    excepts: tuple[str, ...] = ()


@dataclass(frozen=True)
class PortRange:
    protocol: int
    first: int
    last: int


@dataclass(frozen=True)
class Allow:
    """Connections to ``pod`` from any of ``sources`` (None: anywhere) to any of ``ports``
    (None: every port)."""

    pod: str
    sources: tuple[Source, ...] | None
    ports: tuple[PortRange, ...] | None


@dataclass(frozen=True)
class Ruleset:
    """What the cluster's policies allow: the isolated pods' IPs and their allowances."""

    isolated: tuple[str, ...]
    allows: tuple[Allow, ...]


# --- what the policies say ------------------------------------------------------------------
def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector's verdict on ``labels`` (an empty selector selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(obj["metadata"].get("labels") or {})


def _ports(rule: Mapping[str, Any], pod: Mapping[str, Any]) -> tuple[PortRange, ...] | None:
    """A rule's ports at ``pod`` (a named port is the pod's container port of that name)."""
    if not rule.get("ports"):
        return None
    named = {
        p["name"]: int(p["containerPort"])
        for c in pod["spec"].get("containers") or []
        for p in c.get("ports") or []
        if p.get("name")
    }
    ranges = []
    for entry in rule["ports"]:
        protocol = PROTOCOLS[entry.get("protocol", "TCP")]
        port = entry.get("port")
        if port is None:
            ranges.append(PortRange(protocol, 0, 65535))
        elif isinstance(port, int):
            ranges.append(PortRange(protocol, port, int(entry.get("endPort") or port)))
        elif port in named:
            ranges.append(PortRange(protocol, named[port], named[port]))
    return tuple(ranges)


def _sources(
    rule: Mapping[str, Any],
    namespace: str,
    pods: list[dict[str, Any]],
    namespaces: Mapping[str, dict[str, str]],
) -> tuple[Source, ...] | None:
    """The sources a rule's ``from`` admits (None: every source)."""
    if not rule.get("from"):
        return None
    found: list[Source] = []
    for peer in rule["from"]:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            found.append(Source(block["cidr"], tuple(block.get("except") or ())))
            continue
        if "namespaceSelector" in peer:
            chosen = {n for n, labels in namespaces.items()
                      if selects(peer["namespaceSelector"], labels)}  # fmt: skip
        else:
            chosen = {namespace}
        found += [
            Source(f"{p['status']['podIP']}/32")
            for p in pods
            if p["metadata"]["namespace"] in chosen and selects(peer.get("podSelector"), _labels(p))
        ]
    return tuple(found)


def ruleset(
    policies: Iterable[dict[str, Any]],
    pods: list[dict[str, Any]],
    namespaces: Mapping[str, dict[str, str]],
) -> Ruleset:
    """What ``policies`` allow between ``pods`` (those with their own IP), in ``namespaces``
    (name to labels)."""
    isolated: set[str] = set()
    allows: set[Allow] = set()
    for policy in policies:
        spec, namespace = policy["spec"], policy["metadata"]["namespace"]
        types = spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]
        if "Ingress" not in types:
            continue
        targets = [
            p for p in pods
            if p["metadata"]["namespace"] == namespace
            and selects(spec.get("podSelector"), _labels(p))
        ]  # fmt: skip
        for pod in targets:
            ip = pod["status"]["podIP"]
            isolated.add(ip)
            for rule in spec.get("ingress") or []:
                sources = _sources(rule, namespace, pods, namespaces)
                ports = _ports(rule, pod)
                if sources != () and ports != ():  # () admits nothing; None, everything
                    allows.add(Allow(ip, sources, ports))
    return Ruleset(tuple(sorted(isolated)), tuple(sorted(allows, key=repr)))


# --- nftables ---------------------------------------------------------------------------------
def _expr(name: str, **attrs: Any) -> dict[str, Any]:
    data = [(f"NFTA_{name.upper()}_{k.upper()}", v) for k, v in attrs.items()]
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": data})]}


def _value(raw: bytes) -> dict[str, Any]:
    return {"attrs": [("NFTA_DATA_VALUE", raw)]}


def _cmp(raw: bytes, op: int = 0) -> dict[str, Any]:
    return _expr("cmp", sreg=1, op=op, data=_value(raw))


def _payload(base: int, offset: int, length: int) -> dict[str, Any]:
    return _expr("payload", **OrderedDict(dreg=1, base=base, offset=offset, len=length))


def _and(mask: bytes) -> dict[str, Any]:
    """The register's 4 bytes and ``mask``."""
    zero = _value(bytes(4))
    return _expr("bitwise", **OrderedDict(sreg=1, dreg=1, len=4, mask=_value(mask), xor=zero))


def _address(offset: int, cidr: str) -> list[dict[str, Any]]:
    """The IPv4 header's address at ``offset`` (12: source, 16: destination) in ``cidr``."""
    net = ipaddress.IPv4Network(cidr, strict=False)
    mask = struct.pack("!I", int(net.netmask))
    return [
        _payload(1, offset, 4),
        _and(mask),
        _cmp(socket.inet_aton(str(net.network_address))),
    ]


def _port(ports: PortRange) -> list[dict[str, Any]]:
    return [
        _expr("meta", key=16, dreg=1),  # l4proto
        _cmp(bytes([ports.protocol])),
        _payload(2, 2, 2),  # the transport header's destination port
        _cmp(struct.pack("!H", ports.first), op=5),  # >=
        _cmp(struct.pack("!H", ports.last), op=3),  # <=
    ]


def _verdict(code: int, chain: str = "") -> dict[str, Any]:
    verdict: list[tuple[str, Any]] = [("NFTA_VERDICT_CODE", code)]
    if chain:
        verdict.append(("NFTA_VERDICT_CHAIN", chain))
    data = {"attrs": [("NFTA_DATA_VERDICT", {"attrs": verdict})]}
    return _expr("immediate", dreg=0, data=data)


def _established() -> list[dict[str, Any]]:
    return [
        _expr("ct", key=0, dreg=1),  # state
        _and(struct.pack("=I", CT_ESTABLISHED_OR_RELATED)),  # the kernel's byte order
        _cmp(b"\0\0\0\0", op=1),
    ]


def _rules(rules: Ruleset) -> tuple[list[str], list[tuple[str, list[dict[str, Any]]]]]:
    """The table's extra chains (one per address block with exceptions) and its rules, each
    with its chain."""
    chains: list[str] = []
    out: list[tuple[str, list[dict[str, Any]]]] = [("forward", [*_established(), _verdict(1)])]
    for allow in rules.allows:
        target = _address(16, f"{allow.pod}/32")
        for source in allow.sources or (None,):
            matches = list(target)
            verdict = _verdict(NF_ACCEPT)
            if source is not None:
                matches += _address(12, source.cidr)
                if source.excepts:
                    chain = f"except{len(chains)}"
                    chains.append(chain)
                    out += [(chain, [*_address(12, e), _verdict(NFT_RETURN)])
                            for e in source.excepts]  # fmt: skip
                    out.append((chain, [_verdict(NF_ACCEPT)]))
                    verdict = _verdict(NFT_JUMP, chain)
            for ports in allow.ports or (None,):
                out.append(("forward", [*matches, *(_port(ports) if ports else []), verdict]))
    out += [("forward", [*_address(16, f"{ip}/32"), _verdict(NF_DROP)]) for ip in rules.isolated]
    return chains, out


class Tables:
    """A cluster's rules in the kernel: one table at a time, replaced whole."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._generation = 0

    def apply(self, rules: Ruleset) -> None:
        """Writes ``rules`` as a new table, then removes the previous one."""
        self._generation += 1
        table = f"{_prefix(self.tag)}_{self._generation}"
        chains, out = _rules(rules)
        with NFTables(nfgen_family=1) as nft:  # inet
            nft.table("add", name=table)
            nft.chain("add", table=table, name="forward", hook="forward", type="filter",
                      policy=NF_ACCEPT)  # fmt: skip
            for chain in chains:
                nft.chain("add", table=table, name=chain)
            for chain, expressions in out:
                nft.rule("add", table=table, chain=chain, expressions=[expressions])
        remove_tables(self.tag, keep=table)
        log.info("network policies: %d pods isolated, %d rules", len(rules.isolated), len(out))


class Enforcer:
    """Keeps the kernel's rules equal to what the cluster's policies allow (see the module)."""

    def __init__(self, rest: Rest, tag: str) -> None:
        self.rest = rest
        self.tables = Tables(tag)
        self._applied: Ruleset | None = None
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netpol", daemon=True)

    def start(self) -> None:
        remove_tables(self.tables.tag)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        remove_tables(self.tables.tag)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD):
            try:
                self.sync()
            except (ApiError, OSError) as err:
                log.warning("network policies not applied: %s", err)
            except Exception:
                log.exception("network policies not applied")

    def sync(self) -> None:
        policies = self.rest.get("/apis/networking.k8s.io/v1/networkpolicies")["items"]
        for p in policies:
            key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            if p["spec"].get("egress") and key not in self._warned:
                self._warned.add(key)
                log.warning("policy %s: its egress rules are not enforced here", key)
        pods = [
            p
            for p in self.rest.get("/api/v1/pods")["items"]
            if not p["spec"].get("hostNetwork") and (p.get("status") or {}).get("podIP")
        ]
        namespaces = {n["metadata"]["name"]: _labels(n)
                      for n in self.rest.get("/api/v1/namespaces")["items"]}  # fmt: skip
        wanted = ruleset(policies, pods, namespaces)
        if wanted != self._applied:
            self.tables.apply(wanted)
            self._applied = wanted


def _prefix(tag: str) -> str:
    return tag.replace("-", "_").rstrip("_")


def remove_tables(tag: str, keep: str = "") -> None:
    """The tables of the cluster tagged ``tag`` (:func:`netns.cluster_tag`) but ``keep``."""
    with NFTables(nfgen_family=1) as nft:
        names = [t.get_attr("NFTA_TABLE_NAME") for t in nft.get_tables()]
        for name in names:
            if name.startswith(f"{_prefix(tag)}_") and name != keep:
                nft.table("del", name=name)
