"""Settings for the whole suite."""

from __future__ import annotations

import os

# The multi-process tests start hundreds of local jobs: their members fork from a server that
# imported torch once instead of each starting a fresh interpreter (see `liveshard-local`).
# Exported, so the commands and benchmarks the tests run as subprocesses do the same.
os.environ.setdefault("LIVESHARD_LOCAL_START_METHOD", "forkserver")
