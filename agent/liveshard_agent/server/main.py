"""`liveshard-agent`: the process of one worker pod.

    LIVESHARD_JOB=j LIVESHARD_MEMBER=j-abc12 LIVESHARD_POD_IP=10.0.0.7 LIVESHARD_TOKEN=... \\
    LIVESHARD_CONFIG='{"model": {"preset": "tiny"}}' liveshard-agent

Exit status: 0 once released, 1 if it could not serve or its member failed (after a Release),
2 for a bad configuration (one line on stderr naming the variable and field). With
LIVESHARD_POD_MEMBERS from 2 it is the supervisor of a pod of several members instead (`pod`).

SIGTERM does not stop the agent: it reports `terminating` and keeps serving and training until
the operator has moved its state out and released it, or the kubelet kills it at the end of the
grace period. This module owns the command line and signals; the rest is in `process`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import replace

from liveshard_core import logs

from .config import ConfigError, load
from .status import Snapshot, StatusBoard

log = logging.getLogger(__name__)


def _follow_sigterm(board: StatusBoard) -> None:
    """Wait for SIGTERM in a thread of its own (it is blocked everywhere else), so marking the
    status takes locks safely, which a signal handler on the main thread could not."""
    while True:
        signal.sigwait({signal.SIGTERM})
        log.warning("SIGTERM: terminating; serving until released or killed")
        board.update(lambda s: replace(s, terminating=True))


def main(argv: list[str] | None = None) -> int:
    # Blocked before any thread starts, so every thread (grpc's and torch's too) inherits it and
    # SIGTERM is only ever taken by `_follow_sigterm`.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        config = load(os.environ, argv)
    except ConfigError as err:
        print(f"liveshard-agent: {err}", file=sys.stderr)
        return 2
    logs.configure(os.environ.get("LIVESHARD_LOG_LEVEL", "INFO").upper(), config.log_format)
    if config.pod_members > 1:
        from .pod import supervise  # no torch: the pod's members, each an agent, import it

        return supervise(config, os.environ, sys.argv[1:] if argv is None else argv)
    board = StatusBoard(Snapshot(member=config.member, steps=config.job_config.training.steps))
    threading.Thread(target=_follow_sigterm, args=(board,), name="sigterm", daemon=True).start()
    try:
        from .process import serve  # imports torch: the pre-warm starts here

        status = serve(config, board)
    except ConfigError as err:
        print(f"liveshard-agent: {err}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        status = 130
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Torch's stores and process groups may wait for peers that are gone when they are torn down
    # at interpreter exit; the agent has answered its Release and has nothing left to do.
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
