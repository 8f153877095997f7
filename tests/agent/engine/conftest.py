"""Fixtures for the transfer engine's multi-process tests: a pool of spawned worker processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the transfer engine needs torch (the agent extra)")

from liveshard_e2e.workers import Pool

POOL_SIZE = 6  # the largest union of old and new members in these tests


@pytest.fixture(scope="session")
def pool() -> Iterator[Pool]:
    """Six worker processes, shared by the engine tests; a worker that dies is restarted."""
    workers = Pool(POOL_SIZE, "tests.agent.engine.tasks")
    yield workers
    workers.close()
