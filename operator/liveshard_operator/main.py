"""`liveshard-operator`: run the operator (kopf) over some namespaces or the whole cluster, and
serve its Prometheus metrics."""

from __future__ import annotations

import argparse
import logging

import kopf

from liveshard_core import logs

from . import handlers
from .metrics import DEFAULT_PORT

log = logging.getLogger(__name__)


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: object) -> None:
    settings.posting.level = logging.INFO
    settings.persistence.finalizer = "liveshard.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="liveshard.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="liveshard.io")
    settings.watching.server_timeout = 120


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logs.configure(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    assert handlers.run_job  # the handlers register on import
    if args.metrics_port:
        serve_metrics(args.metrics_address, args.metrics_port)
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0


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
