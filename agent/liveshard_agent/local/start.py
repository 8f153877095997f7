"""How `liveshard-local` starts its members' processes (and the test harness its workers'):
fresh interpreters (multiprocessing's `spawn`, the default), or forked from a server process that
imported the given modules once (`LIVESHARD_LOCAL_START_METHOD=forkserver`). No torch here: the
harness imports it without the agent's dependencies."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, SpawnContext

from liveshard_core.errors import InvalidInput

START_METHOD = "LIVESHARD_LOCAL_START_METHOD"


def start_context(preload: Sequence[str]) -> SpawnContext | ForkServerContext:
    """The context to start processes with, as `START_METHOD` says; a forkserver imports
    `preload` before it forks (the first server started in a process keeps its own)."""
    method = os.environ.get(START_METHOD, "spawn")
    if method == "spawn":
        return mp.get_context("spawn")
    if method == "forkserver":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        return ctx
    raise InvalidInput(f"{START_METHOD}={method!r}: expected spawn or forkserver")
