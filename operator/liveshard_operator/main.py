"""`liveshard-operator`: run the operator (kopf) over some namespaces or the whole cluster."""

from __future__ import annotations

import argparse
import logging

import kopf

from . import handlers


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
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    assert handlers.run_job  # the handlers register on import
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    return 0
