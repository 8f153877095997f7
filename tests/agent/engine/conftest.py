"""Fixtures for the transfer engine's multi-process tests: a pool of spawned worker processes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="the transfer engine needs torch (the agent extra)")

from workers import Pool

POOL_SIZE = 6  # the largest union of old and new members in these tests
_epochs = itertools.count(1)


@pytest.fixture(scope="session")
def pool() -> Iterator[Pool]:
    """Six worker processes, shared by the engine tests; a worker that dies is restarted."""
    workers = Pool(POOL_SIZE)
    yield workers
    workers.close()


def names(n: int, start: int = 0) -> list[str]:
    return [f"m{i}" for i in range(start, start + n)]


def run_switch(
    pool: Pool,
    model: Any,
    old: tuple[str, list[str]],
    new: tuple[str, list[str]],
    faults: dict[str, tuple[str, int, float]] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run one switch on the workers serving the union's members (worker i serves `m{i}`), with
    the store hosted by worker 0; returns each member's result by member name."""
    lost = set(kwargs.get("lost", ()))
    members = sorted((set(old[1]) | set(new[1])) - lost, key=lambda m: int(m[1:]))
    port = pool.run({0: ("host_store", {})})[0]
    epoch = next(_epochs)
    tasks = {
        int(m[1:]): ("switch", dict(member=m, port=port, epoch=epoch, model=model, old=old,
                                    new=new, fault=(faults or {}).get(m), **kwargs))
        for m in members
    }  # fmt: skip
    results = pool.run(tasks)
    return {f"m{w}": r for w, r in results.items()}
