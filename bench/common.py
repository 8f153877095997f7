"""What the benchmarks share: the description of the machine a figure was measured on, the best
of repeated timings, and the JSON file a run writes. Each benchmark is a script run from the
repository's root (`python bench/NAME.py`), so this module is found beside it."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def best(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    """`fn`'s result and its fastest time, in seconds, of `repeat` calls."""
    result, seconds = None, float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        seconds = min(seconds, time.perf_counter() - start)
    return result, seconds


def cpu_model() -> str:
    """The processor's model name, as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(what: str = "") -> str:
    """`model, N cpus, M GiB` and what else the figure depends on (`what`: a torch version, the
    transport)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    parts = [cpu_model(), f"{os.cpu_count()} cpus", f"{memory / 2**30:.0f} GiB"]
    return ", ".join(parts + ([what] if what else []))


def write_json(path: str | None, data: Any) -> None:
    """Write a run's results to `path` (its folder created), when one is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))
