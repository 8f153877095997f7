"""Planning benchmark: plans, schedules, member assignment and the layout policy at scale.

Prints one JSON object per measurement (and writes them all to --out when given). Each time is the
best of --repeat runs in this process, on one core (planning is single-threaded Python, numpy for
the assignment).

- `"kind": "plan"`: whole-plan and schedule times for real model shapes (the new layout keeps
  the old members in order);
- `"kind": "member"`: what one agent computes in prepare: its own part of the plan and its rounds
  (`member_seconds`, the slowest of a few members: a stayer of each old stage, a leaver, a
  joiner), given the change's member index (`union_seconds`, one pass over the member lists,
  once per change) and the plan's traffic (in a real switch, one all-reduce); checked equal to
  the member's part of the whole plan's schedule where that is computed (`checked`);
- `"kind": "assign"`: the best member assignment against the in-order one and the lower bound
  (network bytes), the assignment's time and the time of assignment plus plan;
- `"kind": "policy"`: `choose_layout` for a member count, with and without a current layout;
- `"kind": "pods"`: a change of a job whose members come 8 to a pod (a member per GPU): the
  bytes that cross pods and the dry run's pause (the network at 25 GB/s per member, NVLink at
  450 GB/s inside pods) when the plan takes bytes inside pods first, against the plan that
  ignores pods; and the plan's time with pods.

    python bench/plan.py [--quick] [--repeat 3] [--out bench/results/plan.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from common import best, machine, write_json

from liveshard_core.assign.assign import Problem
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.plan.plan import build_plan
from liveshard_core.plan.predict import BANDWIDTH, Links, predict
from liveshard_core.plan.schedule import build_schedule, member_schedule, plan_traffic
from liveshard_core.plan.union import Union
from liveshard_core.plan.view import member_plan
from liveshard_core.policy.layout import Constraints, choose_layout
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, TransformerConfig

BUDGET = 1 << 30

# Dense llama shapes of three sizes, for growth with model size.
LLAMA_SIZES = {
    "llama-7b": TransformerConfig("llama-7b", 32000, 4096, 32, 32, 32, 128, 11008),
    "llama-13b": TransformerConfig("llama-13b", 32000, 5120, 40, 40, 40, 128, 13824),
}


def layouts(spec: ModelSpec, old_text: str, new_text: str) -> tuple[Layout, Layout]:
    """Old members 0..N-1; the new layout keeps them in order, dropping or adding at the end."""
    old_degrees, new_degrees = parse_degrees(old_text), parse_degrees(new_text)
    old_members = [str(i) for i in range(old_degrees.world_size)]
    extra = [str(old_degrees.world_size + i) for i in range(new_degrees.world_size)]
    new_members = (old_members + extra)[: new_degrees.world_size]
    return old_degrees.layout(spec, old_members), new_degrees.layout(spec, new_members)


def measure(spec: ModelSpec, old_text: str, new_text: str, repeat: int) -> dict[str, Any]:
    old, new = layouts(spec, old_text, new_text)

    def whole() -> Any:
        plan = build_plan(spec, old, new)
        return plan, plan.digest

    (plan, digest), plan_seconds = best(whole, repeat)
    schedule, schedule_seconds = best(lambda: build_schedule(plan, BUDGET), repeat)
    return {
        "kind": "plan",
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


def measure_member(
    spec: ModelSpec, old_text: str, new_text: str, repeat: int, check: bool
) -> dict[str, Any]:
    """One member's part and rounds; the plan's traffic comes from the whole plan, computed once
    outside the timing (an agent gets it from one all-reduce of every member's own)."""
    old, new = layouts(spec, old_text, new_text)
    plan = build_plan(spec, old, new)
    traffic = plan_traffic(plan)
    schedule = build_schedule(plan, BUDGET) if check else None
    union, union_seconds = best(lambda: Union(old, new), repeat)
    stride = old.world_size // old.pp
    members = [old.members[r] for r in range(5, old.world_size, stride)]
    members += [old.members[-1], new.members[-1]]
    slowest, pieces = 0.0, 0
    for member in members:

        def own(member: str = member) -> Any:
            part = member_plan(spec, old, new, member, union=union)
            return part, member_schedule(part, traffic, BUDGET)

        (part, rounds), seconds = best(own, repeat)
        slowest = max(slowest, seconds)
        pieces = max(pieces, sum(map(len, part.patterns)))
        if schedule is not None:
            assert rounds.slot_rounds(part.slot) == schedule.slot_rounds(part.slot), member
    return {
        "kind": "member",
        "model": spec.config.name,
        "from": old_text,
        "to": new_text,
        "ranks_from": old.world_size,
        "ranks_to": new.world_size,
        "members_timed": len(members),
        "member_seconds": round(slowest, 4),
        "union_seconds": round(union_seconds, 4),
        "member_pieces": pieces,
        "rounds": len(rounds.rounds),
        "checked": schedule is not None,
    }


def measure_pods(
    spec: ModelSpec, old_text: str, new_text: str, per_pod: int, repeat: int
) -> dict[str, Any]:
    """Bytes across pods and the predicted pause, with the pods given to the plan and without."""
    old, new = layouts(spec, old_text, new_text)
    members = dict.fromkeys([*old.members, *new.members])
    pods = {m: f"pod-{i // per_pod}" for i, m in enumerate(members)}
    links = Links(pods, 450e9)
    with_pods, seconds = best(lambda: build_plan(spec, old, new, pods=pods), repeat)
    out: dict[str, Any] = {
        "kind": "pods", "model": spec.config.name, "from": old_text, "to": new_text,
        "members_per_pod": per_pod, "ranks_from": old.world_size, "ranks_to": new.world_size,
        "network_bytes": with_pods.network_bytes, "plan_seconds": round(seconds, 4),
    }  # fmt: skip
    for label, plan in (("pods", with_pods), ("ignoring_pods", build_plan(spec, old, new))):
        assert plan.network_bytes == with_pods.network_bytes
        pause = predict(build_schedule(plan, BUDGET), BANDWIDTH, links=links).pause_seconds
        out[f"across_pods_bytes_{label}"] = plan.across_pods_bytes(pods)
        out[f"predicted_pause_seconds_{label}"] = round(pause, 3)
    return out


def cases(quick: bool) -> list[tuple[ModelSpec, str, str]]:
    llama, qwen = preset("llama-70b"), preset("qwen3-235b-a22b")
    out = [
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1"),
        (qwen, "tp=4,pp=8,dp=32,ep=8,zero=1", "tp=4,pp=8,dp=24,ep=8,zero=1"),
    ]
    if quick:
        return out
    # Growth with ranks: 128 .. 8192 ranks, pp 8 -> 4 and two dp groups fewer.
    for dp in (2, 4, 8, 16, 32, 64, 128):
        out.append((llama, f"tp=8,pp=8,dp={dp},zero=1", f"tp=8,pp=4,dp={2 * dp - 2},zero=1"))
    # Growth with model size: the same 1024 -> 960 rank change.
    for config in LLAMA_SIZES.values():
        spec = ModelSpec.from_config(config)
        out.append((spec, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1"))
    return out


def member_cases(quick: bool) -> list[tuple[ModelSpec, str, str, bool]]:
    """(model, from, to, check against the whole schedule): 1024, 8192 and 65536 ranks."""
    llama, qwen = preset("llama-70b"), preset("qwen3-235b-a22b")
    out = [
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1", True),
        (qwen, "tp=4,pp=8,dp=32,ep=8,zero=1", "tp=4,pp=8,dp=24,ep=8,zero=1", True),
    ]
    if not quick:
        out.append((llama, "tp=8,pp=8,dp=128,zero=1", "tp=8,pp=4,dp=254,zero=1", True))
        out.append((llama, "tp=8,pp=8,dp=1024,zero=1", "tp=8,pp=4,dp=2046,zero=1", False))
    return out


def measure_assign(
    spec: ModelSpec, old_text: str, new_text: str, drop: range, repeat: int
) -> dict[str, Any]:
    """Best against in-order assignment when the members in `drop` leave (old member numbers)."""
    old_degrees, new_degrees = parse_degrees(old_text), parse_degrees(new_text)
    old = old_degrees.layout(spec, [str(i) for i in range(old_degrees.world_size)])
    survivors = [i for i in range(old.world_size) if i not in drop]
    joiners = max(new_degrees.world_size - len(survivors), 0)

    def decide() -> Any:
        problem = Problem(spec, old, new_degrees)
        return problem, problem.best(survivors, joiners)

    (problem, best_choice), assign_seconds = best(decide, repeat)
    taking = new_degrees.world_size - joiners
    ordered = problem.given([*survivors[:taking], *([None] * joiners)], survivors)
    fresh = iter(range(old.world_size, 10**9))
    members = [str(m) if m is not None else str(next(fresh)) for m in best_choice.members_to]
    new = new_degrees.layout(spec, members)

    def whole() -> Any:
        plan = build_plan(spec, old, new)
        return plan, plan.digest

    (plan, _), plan_seconds = best(whole, repeat)
    assert plan.network_bytes == best_choice.network_bytes
    lower = best_choice.lower_bound_bytes
    return {
        "kind": "assign",
        "model": spec.config.name,
        "from": old_text,
        "to": new_text,
        "members_dropped": f"{drop.start}-{drop.stop - 1}" if drop else "",
        "ranks_from": old.world_size,
        "ranks_to": new.world_size,
        "best_network_bytes": best_choice.network_bytes,
        "ordered_network_bytes": ordered.network_bytes,
        "lower_bound_bytes": lower,
        "fewer_than_ordered": round(1 - best_choice.network_bytes / ordered.network_bytes, 4),
        "above_lower_bound": round(best_choice.network_bytes / lower - 1, 5) if lower else 0.0,
        "spares": len(best_choice.spares),
        "assign_seconds": round(assign_seconds, 4),
        "plan_seconds": round(plan_seconds, 4),
        "assign_and_plan_seconds": round(assign_seconds + plan_seconds, 4),
    }


def measure_policy(
    spec: ModelSpec, members: int, current: str | None, repeat: int, **constraints: Any
) -> dict[str, Any]:
    layout = None
    if current is not None:
        degrees = parse_degrees(current)
        layout = degrees.layout(spec, [str(i) for i in range(degrees.world_size)])
    choice, seconds = best(
        lambda: choose_layout(spec, members, Constraints(**constraints), None, layout), repeat
    )
    return {
        "kind": "policy",
        "model": spec.config.name,
        "members": members,
        "from": current,
        "constraints": constraints,
        "layout": choice.describe(),
        "spares": len(choice.spares),
        "candidates": choice.candidates,
        "step_seconds": round(choice.estimate.step_seconds, 3),
        "memory_bytes": choice.estimate.memory,
        "bytes_to_move": choice.bytes_to_move,
        "policy_seconds": round(seconds, 4),
    }


def assign_cases(quick: bool) -> list[tuple[ModelSpec, str, str, range]]:
    llama, qwen = preset("llama-70b"), preset("qwen3-235b-a22b")
    out = [
        # One node (members 40-47: stage 0, dp index 5) leaves a 1024-rank job.
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=8,dp=15,zero=1", range(40, 48)),
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=30,zero=1", range(0)),
        (qwen, "tp=4,pp=8,dp=32,ep=8,zero=1", "tp=4,pp=8,dp=24,ep=8,zero=1", range(0)),
    ]
    if not quick:
        out += [
            (llama, "tp=8,pp=8,dp=128,zero=1", "tp=8,pp=8,dp=127,zero=1", range(40, 48)),
            (llama, "tp=8,pp=8,dp=128,zero=1", "tp=8,pp=4,dp=254,zero=1", range(0)),
        ]
    return out


def policy_cases(quick: bool) -> list[tuple[ModelSpec, int, str | None, dict[str, Any]]]:
    llama, qwen = preset("llama-70b"), preset("qwen3-235b-a22b")
    out: list[tuple[ModelSpec, int, str | None, dict[str, Any]]] = [
        (llama, 1016, None, {"tp": 8, "global_batch": 1920}),
        (llama, 1016, "tp=8,pp=8,dp=16,zero=1", {"tp": 8, "global_batch": 1920}),
        (qwen, 1024, None, {"tp": 4}),
    ]
    if not quick:
        out += [
            (llama, 8184, None, {"tp": 8, "global_batch": 15360}),
            (llama, 8184, "tp=8,pp=8,dp=128,zero=1", {"tp": 8, "global_batch": 15360}),
        ]
    return out


def pod_cases(quick: bool) -> list[tuple[ModelSpec, str, str]]:
    """1024 members, 8 to a pod: tp narrowed inside pods, pp halved, and (full run) a MoE."""
    llama, qwen = preset("llama-70b"), preset("qwen3-235b-a22b")
    out = [
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=4,pp=8,dp=32,zero=1"),
        (llama, "tp=8,pp=8,dp=16,zero=1", "tp=8,pp=4,dp=32,zero=1"),
    ]
    if not quick:
        out.append((qwen, "tp=4,pp=8,dp=32,ep=8,zero=1", "tp=2,pp=8,dp=64,ep=8,zero=1"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the two headline cases only")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="also write all results to this JSON file")
    args = parser.parse_args()
    described = machine()
    results = []

    def emit(result: dict[str, Any]) -> None:
        result["machine"] = described
        results.append(result)
        print(json.dumps(result), flush=True)

    for spec, old, new in cases(args.quick):
        emit(measure(spec, old, new, args.repeat))
    for spec, old, new, check in member_cases(args.quick):
        emit(measure_member(spec, old, new, args.repeat, check))
    for spec, old, new, drop in assign_cases(args.quick):
        emit(measure_assign(spec, old, new, drop, args.repeat))
    for spec, old, new in pod_cases(args.quick):
        emit(measure_pods(spec, old, new, 8, args.repeat))
    for spec, members, current, constraints in policy_cases(args.quick):
        emit(measure_policy(spec, members, current, args.repeat, **constraints))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
