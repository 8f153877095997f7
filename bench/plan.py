"""Planning benchmark: whole-plan, one-member-view and schedule times for real model shapes.

Prints one JSON object per measurement (and writes them all to --out when given). Each time is the
best of --repeat runs in this process, on one core (planning is single-threaded Python).

    python bench/plan.py [--quick] [--repeat 3] [--out bench/results/plan.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.plan.plan import build_plan
from liveshard_core.plan.schedule import build_schedule
from liveshard_core.plan.view import plan_view
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, TransformerConfig

BUDGET = 1 << 30

# Dense llama shapes of three sizes, for growth with model size.
LLAMA_SIZES = {
    "llama-7b": TransformerConfig("llama-7b", 32000, 4096, 32, 32, 32, 128, 11008),
    "llama-13b": TransformerConfig("llama-13b", 32000, 5120, 40, 40, 40, 128, 13824),
}


def best(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    result, seconds = None, float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        seconds = min(seconds, time.perf_counter() - start)
    return result, seconds


def layouts(spec: ModelSpec, old_text: str, new_text: str) -> tuple[Layout, Layout]:
    """Old members 0..N-1; the new layout keeps them in order, dropping or adding at the end."""
    old_degrees, new_degrees = parse_degrees(old_text), parse_degrees(new_text)
    old_members = [str(i) for i in range(old_degrees.world_size)]
    extra = [str(old_degrees.world_size + i) for i in range(new_degrees.world_size)]
    new_members = (old_members + extra)[: new_degrees.world_size]
    return old_degrees.layout(spec, old_members), new_degrees.layout(spec, new_members)


def measure(
    spec: ModelSpec, old_text: str, new_text: str, repeat: int, view: bool
) -> dict[str, Any]:
    old, new = layouts(spec, old_text, new_text)

    def whole() -> Any:
        plan = build_plan(spec, old, new)
        return plan, plan.digest

    (plan, digest), plan_seconds = best(whole, repeat)
    schedule, schedule_seconds = best(lambda: build_schedule(plan, BUDGET), repeat)
    out: dict[str, Any] = {
        "model": spec.config.name,
        "from": old_text,
        "to": new_text,
        "ranks_from": old.world_size,
        "ranks_to": new.world_size,
        "logical_tensors": 4 * len(spec.params),
        "state_bytes": spec.state_bytes,
        "network_bytes": plan.network_bytes,
        "transfers": plan.network_pieces,
        "patterns": len(plan.patterns),
        "plan_seconds": round(plan_seconds, 4),
        "schedule_seconds": round(schedule_seconds, 4),
        "rounds": len(schedule.rounds),
        "budget_bytes": BUDGET,
        "plan_hash": digest[:16],
    }
    if view:
        # The slowest of a few members spread over the old stages, plus one that only joins.
        members = [old.members[r] for r in range(0, old.world_size, old.world_size // 4)]
        members += [m for m in new.members if m not in set(old.members)][:1]
        out["view_seconds"] = round(
            max(best(lambda m=m: plan_view(spec, old, new, m), repeat)[1] for m in members), 4
        )
    return out


def cases(quick: bool) -> list[tuple[ModelSpec, str, str, bool]]:
    llama, qwen = preset("llama-70b"), preset("qwen3-235b-a22b")
    out = [
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1", True),
        (qwen, "tp=4,pp=8,dp=32,ep=8,zero=1", "tp=4,pp=8,dp=24,ep=8,zero=1", True),
    ]
    if quick:
        return out
    # Growth with ranks: 128 .. 8192 ranks, pp 8 -> 4 and two dp groups fewer.
    for dp in (2, 4, 8, 16, 32, 64, 128):
        out.append((llama, f"tp=8,pp=8,dp={dp},zero=1", f"tp=8,pp=4,dp={2 * dp - 2},zero=1", False))
    # Growth with model size: the same 1024 -> 960 rank change.
    for config in LLAMA_SIZES.values():
        spec = ModelSpec.from_config(config)
        out.append((spec, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1", False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the two headline cases only")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="also write all results to this JSON file")
    args = parser.parse_args()
    results = []
    for spec, old, new, view in cases(args.quick):
        result = measure(spec, old, new, args.repeat, view)
        result["machine"] = f"{platform.machine()} {platform.processor() or ''}".strip()
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
