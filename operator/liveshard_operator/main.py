"""`liveshard-operator`: run the operator (kopf) over some namespaces or the whole cluster, serve
its Prometheus metrics, and, with `--leader-elect`, reconcile only while it holds the Lease."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import uuid
from pathlib import Path

import kopf

from liveshard_core import logs

from . import handlers
from .act import Options
from .leader import Election, Elector
from .metrics import DEFAULT_PORT
from .render import CERT_MANAGER, Isolation, IssuerRef

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: object) -> None:
    settings.posting.level = logging.INFO
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="liveshard.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="liveshard.io")
    settings.watching.server_timeout = 120


def main(argv: list[str] | None = None) -> int:
    flags = parser()
    args = flags.parse_args(argv)
    logs.configure(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    assert handlers.job_changed  # the handlers register on import
    try:
        isolation = isolation_of(args)
        issuer = issuer_of(args.cert_manager_issuer)
    except ValueError as err:
        flags.error(str(err))
    handlers.OPTIONS = Options(cert_manager=args.cert_manager or issuer is not None,
                               cert_manager_issuer=issuer, isolation=isolation)  # fmt: skip
    if args.leader_elect:
        try:
            election = election_of(args)
        except ValueError as err:
            flags.error(str(err))
        handlers.ELECTOR = Elector(handlers.api(), election, changed=handlers.wake_all)
        handlers.METRICS.leader.set(0)  # a standby until the Lease is taken
        log.info("leader election on lease %s/%s as %s", election.namespace, election.name,
                 election.identity)  # fmt: skip
        handlers.ELECTOR.start()
    if args.metrics_port:
        serve_metrics(args.metrics_address, args.metrics_port)
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0


def parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = argparse.ArgumentParser(prog="liveshard-operator", description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--namespace", action="append", help="a namespace to watch (repeatable)")
    where.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", help="serve kopf's health check at this URL")
    parser.add_argument(
        "--metrics-port", type=_port, default=DEFAULT_PORT,
        help=f"serve Prometheus metrics at /metrics on this port; 0: none (default {DEFAULT_PORT})",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-address", default="0.0.0.0",
        help="the address to serve metrics on (the chart gives the pod's IP; default 0.0.0.0)",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", choices=logs.FORMATS, default="text",
        help="text, or json: one JSON object per log line (default text)",
    )  # fmt: skip
    parser.add_argument(
        "--cert-manager", action="store_true",
        help="have cert-manager issue each job's CA and certificates (cert-manager.io/v1 "
        "Issuers and Certificates the operator creates) rather than issuing them itself",
    )  # fmt: skip
    parser.add_argument(
        "--cert-manager-issuer", metavar="KIND/NAME",
        help="have this cert-manager issuer of yours issue every job's certificates (implies "
        "--cert-manager): Issuer/NAME (in the job's namespace), ClusterIssuer/NAME, or "
        "KIND.GROUP/NAME for an external issuer; it must put its CA in ca.crt",
    )  # fmt: skip
    _network_policy_flags(parser)
    _leader_election_flags(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def _network_policy_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "a NetworkPolicy per job (made when the operator's pods are named; the chart names them)"
    )
    group.add_argument(
        "--operator-pod-labels", metavar="KEY=VALUE,...",
        help="labels of the operator's pods, which alone may call the agents: each job then gets "
        "a NetworkPolicy that lets only its own workers and those pods reach its workers",
    )  # fmt: skip
    group.add_argument(
        "--operator-namespace",
        help="the operator pods' namespace (default: $POD_NAMESPACE, else the service account's)",
    )
    group.add_argument(
        "--job-metrics-from", metavar="JSON", default="[]",
        help="who may scrape the workers' metrics port: a JSON list of NetworkPolicyPeers "
        "(default []: anyone)",
    )  # fmt: skip


def issuer_of(value: str | None) -> IssuerRef | None:
    """The issuer `--cert-manager-issuer` names (None: none); ValueError when malformed."""
    if not value:
        return None
    kind, _, name = value.partition("/")
    kind, _, group = kind.partition(".")
    if not kind or not name or "/" in name:
        raise ValueError(f"--cert-manager-issuer: expected KIND/NAME (Issuer/NAME, "
                         f"ClusterIssuer/NAME or KIND.GROUP/NAME), got {value!r}")  # fmt: skip
    return IssuerRef(name, kind, group or CERT_MANAGER)


def isolation_of(args: argparse.Namespace) -> Isolation | None:
    """The per-job NetworkPolicy's peers the flags name (None: no policy); ValueError naming a
    malformed flag."""
    if not args.operator_pod_labels:
        return None
    labels = dict(pair.partition("=")[::2] for pair in args.operator_pod_labels.split(","))
    if any(not key or not value for key, value in labels.items()):
        raise ValueError(f"--operator-pod-labels: expected KEY=VALUE,..., got "
                         f"{args.operator_pod_labels!r}")  # fmt: skip
    namespace = args.operator_namespace or _own_namespace()
    if not namespace:
        raise ValueError("--operator-pod-labels needs --operator-namespace outside a pod")
    try:
        peers = json.loads(args.job_metrics_from)
    except json.JSONDecodeError as err:
        raise ValueError(f"--job-metrics-from: not JSON: {err}") from None
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ValueError("--job-metrics-from: expected a JSON list of NetworkPolicyPeer objects")
    return Isolation(namespace, labels, peers)


def _own_namespace() -> str:
    """$POD_NAMESPACE, else the service account's namespace ("" outside a pod)."""
    namespace = os.environ.get("POD_NAMESPACE", "")
    if not namespace and SERVICE_ACCOUNT_NAMESPACE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return namespace


def _leader_election_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("leader election (kube-controller-manager's flags)")
    group.add_argument(
        "--leader-elect", action=argparse.BooleanOptionalAction, default=False,
        help="reconcile only while holding a coordination.k8s.io Lease, so that replicas stand "
        "by for each other (default off: a single operator)",
    )  # fmt: skip
    group.add_argument("--leader-elect-lease-name", default="liveshard-operator",
                       help="the Lease's name (default liveshard-operator)")  # fmt: skip
    group.add_argument(
        "--leader-elect-namespace",
        help="the Lease's namespace (default: $POD_NAMESPACE, else the service account's)",
    )
    group.add_argument(
        "--leader-elect-identity",
        help="this replica's holderIdentity (default: $POD_NAME or the host name, and a random "
        "suffix)",
    )  # fmt: skip
    for flag, default, what in (
        ("lease-duration", 15.0, "how long a standby waits on a Lease that is not renewed"),
        ("renew-deadline", 10.0, "how long the leader tries to renew before it steps down"),
        ("retry-period", 2.0, "how often a replica tries to acquire or renew the Lease"),
    ):
        group.add_argument(f"--leader-elect-{flag}", type=float, default=default, metavar="SECONDS",
                           help=f"{what} (default {default:g})")  # fmt: skip


def election_of(args: argparse.Namespace) -> Election:
    """The election the flags ask for; ValueError naming what is missing or inconsistent."""
    namespace = args.leader_elect_namespace or _own_namespace()
    if not namespace:
        raise ValueError("--leader-elect needs --leader-elect-namespace outside a pod")
    identity = args.leader_elect_identity or (
        f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    )
    return Election(
        namespace=namespace,
        name=args.leader_elect_lease_name,
        identity=identity,
        lease_duration=args.leader_elect_lease_duration,
        renew_deadline=args.leader_elect_renew_deadline,
        retry_period=args.leader_elect_retry_period,
    )


def serve_metrics(address: str, port: int) -> None:
    """Serve the operator's metrics, or log why not: jobs are worth more than their metrics
    (operators sharing one address, as local test runs may, find the default port taken)."""
    try:
        handlers.METRICS.serve(address, port)
    except OSError as err:
        log.warning("no metrics: cannot serve on %s:%s: %s", address, port, err)
        return
    log.info("serving metrics at %s:%s/metrics", address, port)


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number in 0..65535")
    return port
