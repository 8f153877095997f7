"""The NetworkPolicies of a cluster whose pods have network namespaces, enforced in the host's
kernel with nftables, as a network plugin's policy agent enforces them.

Every half second the enforcer lists the policies, pods and namespaces; when what they allow
changed, it writes a new table and then removes the old one (two tables both apply in between,
so a change never opens more than either allows). Traffic between pods crosses the host's
forward path (:mod:`liveshard_e2e.kubelet.netns`), a pod's traffic to the host its input path.
The table accepts packets of connections already admitted; a connection from a pod that an
Egress policy selects must be admitted by some egress rule of those policies (on both paths),
and one to a pod that an Ingress policy selects by some ingress rule (peers: pods, namespaces or
address blocks with their exceptions; ports, named ports and port ranges); the rest is dropped.
A pod no policy selects is open. Traffic from the host (probes, tests) is never filtered, as
Kubernetes wants of a node.
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
class Peer:
    """An address block a connection may come from (ingress) or go to (egress), less its
    exceptions."""

    cidr: str
    excepts: tuple[str, ...] = ()


@dataclass(frozen=True)
class PortRange:
    protocol: int
    first: int
    last: int


@dataclass(frozen=True)
class Allow:
    """Connections of ``pod`` with any of ``peers`` (None: any address) on any of ``ports``
    (None: every port), the destination's: to ``pod`` for ingress, from it for egress."""

    pod: str
    peers: tuple[Peer, ...] | None
    ports: tuple[PortRange, ...] | None


@dataclass(frozen=True)
class Ruleset:
    """What the cluster's policies allow: the IPs of the pods isolated for ingress and their
    allowances, and those of the pods isolated for egress and theirs."""

    isolated: tuple[str, ...]
    allows: tuple[Allow, ...]
    egress_isolated: tuple[str, ...] = ()
    egress_allows: tuple[Allow, ...] = ()


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


def _named(pod: Mapping[str, Any]) -> dict[str, int]:
    """A pod's named container ports."""
    return {
        p["name"]: int(p["containerPort"])
        for c in pod["spec"].get("containers") or []
        for p in c.get("ports") or []
        if p.get("name")
    }


def _range(entry: Mapping[str, Any], named: Mapping[str, int]) -> PortRange | None:
    """A rule's port entry as a range; None for a name not in ``named``."""
    protocol = PROTOCOLS[entry.get("protocol", "TCP")]
    port = entry.get("port")
    if port is None:
        return PortRange(protocol, 0, 65535)
    if isinstance(port, int):
        return PortRange(protocol, port, int(entry.get("endPort") or port))
    return PortRange(protocol, named[port], named[port]) if port in named else None


def _ports(rule: Mapping[str, Any], named: Mapping[str, int]) -> tuple[PortRange, ...] | None:
    """A rule's ports, names resolved in ``named`` (None: every port; (): none)."""
    if not rule.get("ports"):
        return None
    ranges = (_range(entry, named) for entry in rule["ports"])
    return tuple(r for r in ranges if r is not None)


def _peers(
    peers: list[dict[str, Any]] | None,
    namespace: str,
    pods: list[dict[str, Any]],
    namespaces: Mapping[str, dict[str, str]],
) -> tuple[Peer, ...] | None:
    """The addresses a rule's ``from`` or ``to`` admits (None: every address)."""
    if not peers:
        return None
    found: list[Peer] = []
    for peer in peers:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            found.append(Peer(block["cidr"], tuple(block.get("except") or ())))
            continue
        if "namespaceSelector" in peer:
            chosen = {n for n, labels in namespaces.items()
                      if selects(peer["namespaceSelector"], labels)}  # fmt: skip
        else:
            chosen = {namespace}
        found += [
            Peer(f"{p['status']['podIP']}/32")
            for p in pods
            if p["metadata"]["namespace"] in chosen and selects(peer.get("podSelector"), _labels(p))
        ]
    return tuple(found)


def _covers(peers: tuple[Peer, ...] | None, ip: str) -> bool:
    address = ipaddress.IPv4Address(ip)
    return peers is None or any(
        address in ipaddress.IPv4Network(p.cidr, strict=False)
        and not any(address in ipaddress.IPv4Network(e, strict=False) for e in p.excepts)
        for p in peers
    )


def _egress(
    ip: str, rule: Mapping[str, Any], peers: tuple[Peer, ...] | None, pods: list[dict[str, Any]]
) -> list[Allow]:
    """What an egress rule lets the pod at ``ip`` open. A named port is a container port of
    the pod connected to, so each pod among ``peers`` that names it is a peer of its own."""
    ports = _ports(rule, {})
    allows = [Allow(ip, peers, ports)] if ports != () else []
    for entry in rule.get("ports") or []:
        if not isinstance(entry.get("port"), str):
            continue
        for pod in pods:
            target = pod["status"]["podIP"]
            if (found := _range(entry, _named(pod))) is not None and _covers(peers, target):
                allows.append(Allow(ip, (Peer(f"{target}/32"),), (found,)))
    return allows


def ruleset(
    policies: Iterable[dict[str, Any]],
    pods: list[dict[str, Any]],
    namespaces: Mapping[str, dict[str, str]],
) -> Ruleset:
    """What ``policies`` allow between ``pods`` (those with their own IP), in ``namespaces``
    (name to labels)."""
    isolated: dict[str, set[str]] = {"Ingress": set(), "Egress": set()}
    allows: dict[str, set[Allow]] = {"Ingress": set(), "Egress": set()}
    for policy in policies:
        spec, namespace = policy["spec"], policy["metadata"]["namespace"]
        types = spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]
        targets = [
            p for p in pods
            if p["metadata"]["namespace"] == namespace
            and selects(spec.get("podSelector"), _labels(p))
        ]  # fmt: skip
        rules = {kind: spec.get(kind.lower()) or [] for kind in isolated.keys() & set(types)}
        for pod in targets:
            ip = pod["status"]["podIP"]
            for kind in rules:
                isolated[kind].add(ip)
            for rule in rules.get("Ingress", ()):
                peers = _peers(rule.get("from"), namespace, pods, namespaces)
                ports = _ports(rule, _named(pod))
                if peers != () and ports != ():  # () admits nothing; None, everything
                    allows["Ingress"].add(Allow(ip, peers, ports))
            for rule in rules.get("Egress", ()):
                peers = _peers(rule.get("to"), namespace, pods, namespaces)
                if peers != ():
                    allows["Egress"].update(_egress(ip, rule, peers, pods))

    def listed(kind: str) -> tuple[tuple[str, ...], tuple[Allow, ...]]:
        return tuple(sorted(isolated[kind])), tuple(sorted(allows[kind], key=repr))

    return Ruleset(*listed("Ingress"), *listed("Egress"))


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


# The table's base chains: each at its hook, jumping to a regular chain of rules. A packet must
# be accepted by every base chain of its hook (a drop in one is final), in any order.
BASE_CHAINS = (
    ("egress_forward", "forward", "egress"),
    ("egress_input", "input", "egress"),
    ("ingress_forward", "forward", "ingress"),
)

Rules = list[tuple[str, list[dict[str, Any]]]]


def _direction(
    chain: str, isolated: tuple[str, ...], allows: tuple[Allow, ...], own: int, peer: int,
    chains: list[str],
) -> Rules:  # fmt: skip
    """The rules of ``chain``: accept what ``allows`` admit, the pod's address at header offset
    ``own`` and its peer's at ``peer`` (12: source, 16: destination), drop the rest of the
    ``isolated`` pods'. A block with exceptions gets a chain of its own, added to ``chains``."""
    out: Rules = []
    for allow in allows:
        pod = _address(own, f"{allow.pod}/32")
        for block in allow.peers or (None,):
            matches = list(pod)
            verdict = _verdict(NF_ACCEPT)
            if block is not None:
                matches += _address(peer, block.cidr)
                if block.excepts:
                    name = f"except{len(chains)}"
                    chains.append(name)
                    out += [(name, [*_address(peer, e), _verdict(NFT_RETURN)])
                            for e in block.excepts]  # fmt: skip
                    out.append((name, [_verdict(NF_ACCEPT)]))
                    verdict = _verdict(NFT_JUMP, name)
            for ports in allow.ports or (None,):
                out.append((chain, [*matches, *(_port(ports) if ports else []), verdict]))
    return out + [(chain, [*_address(own, f"{ip}/32"), _verdict(NF_DROP)]) for ip in isolated]


def _rules(rules: Ruleset) -> tuple[list[str], Rules]:
    """The table's regular chains and its rules, each with its chain."""
    chains = ["ingress", "egress"]
    out: Rules = [(base, [*_established(), _verdict(NF_ACCEPT)]) for base, _, _ in BASE_CHAINS]
    out += [(base, [_verdict(NFT_JUMP, target)]) for base, _, target in BASE_CHAINS]
    out += _direction("ingress", rules.isolated, rules.allows, 16, 12, chains)
    out += _direction("egress", rules.egress_isolated, rules.egress_allows, 12, 16, chains)
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
            for name, hook, _ in BASE_CHAINS:
                nft.chain("add", table=table, name=name, hook=hook, type="filter",
                          policy=NF_ACCEPT)  # fmt: skip
            for chain in chains:
                nft.chain("add", table=table, name=chain)
            for chain, expressions in out:
                nft.rule("add", table=table, chain=chain, expressions=[expressions])
        remove_tables(self.tag, keep=table)
        log.info("network policies: %d pods isolated for ingress, %d for egress, %d rules",
                 len(rules.isolated), len(rules.egress_isolated), len(out))  # fmt: skip


class Enforcer:
    """Keeps the kernel's rules equal to what the cluster's policies allow (see the module)."""

    def __init__(self, rest: Rest, tag: str) -> None:
        self.rest = rest
        self.tables = Tables(tag)
        self._applied: Ruleset | None = None
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
