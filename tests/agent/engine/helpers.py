"""Running one switch across the engine tests' worker pool."""

from __future__ import annotations

import itertools
from typing import Any

from liveshard_e2e.workers import Pool
from tests.helpers import number

_epochs = itertools.count(1)


def run_switch(
    pool: Pool,
    model: Any,
    old: tuple[str, list[str]],
    new: tuple[str, list[str]],
    faults: dict[str, tuple[str, int, float]] | None = None,
    only: dict[str, dict[str, Any]] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run one switch on the workers serving the union's members (worker i serves `m{i}`), with
    the store hosted by worker 0; returns each member's result by member name. `only` gives some
    members arguments of their own."""
    lost = set(kwargs.get("lost", ()))
    members = sorted((set(old[1]) | set(new[1])) - lost, key=number)
    port = pool.run({0: ("host", {})})[0]
    epoch = next(_epochs)
    tasks = {
        number(m): ("switch", dict(member=m, port=port, epoch=epoch, model=model, old=old,
                                   new=new, fault=(faults or {}).get(m),
                                   **{**kwargs, **(only or {}).get(m, {})}))
        for m in members
    }  # fmt: skip
    results = pool.run(tasks)
    return {f"m{w}": r for w, r in results.items()}
