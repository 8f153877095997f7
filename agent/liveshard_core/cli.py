"""The `liveshard` command line: inspect transfer plans between layouts.

`liveshard plan` numbers members by their rank in the old layout; `--drop` removes some, the rest
take the new layout's ranks from 0 in order, and added members (numbered after the old ones) are
appended. `--replace` gives a dropped member's rank to a new member instead (a replaced pod).
`--lost` drops members that died with their state: the plan takes every byte from surviving
copies, or fails naming a tensor that has none.
With neither `--drop` nor `--replace`, a smaller new layout drops the highest-ranked members.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from .errors import InvalidInput
from .layout.layout import Layout, parse_degrees
from .members import MemberChange, apply_change
from .plan.bounds import lower_bound_bytes
from .plan.plan import Plan, build_plan
from .plan.schedule import build_schedule
from .plan.union import union_members
from .plan.view import plan_view
from .vps.box import Box, volume
from .vps.presets import resolve_model
from .vps.spec import ModelSpec

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(text: str) -> int:
    """`1073741824`, `1GiB`, `512MiB`, `2GB`: a positive number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]i?)?b?\s*", text.lower())
    if not match or int(match[1]) < 1:
        raise InvalidInput(
            f"budget {text!r} is not a positive size like 1073741824, 512MiB or 2GiB"
        )
    return int(match[1]) * _UNITS[match[2] or ""]


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidInput(f"{flag} {text!r} must be comma-separated member numbers") from None


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def plan_summary(
    spec: ModelSpec, old: Layout, new: Layout, budget: int, lost: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The figures `liveshard plan --json` prints for a whole plan."""

    def plan_and_hash() -> tuple[Plan, str]:
        plan = build_plan(spec, old, new, lost)
        return plan, plan.digest

    (plan, digest), plan_seconds = _timed(plan_and_hash)
    schedule, schedule_seconds = _timed(build_schedule, plan, budget)
    sends, recvs = plan.slot_bytes
    kept = set(new.members)
    return {
        "model": spec.config.name,
        "from": old.describe(),
        "to": new.describe(),
        "ranks_from": old.world_size,
        "ranks_to": new.world_size,
        "members_dropped": [m for m in old.members if m not in kept],
        "members_added": [m for m in new.members if m not in set(old.members)],
        "members_lost": sorted(lost, key=int),
        "transfers": plan.network_pieces,
        "network_bytes": plan.network_bytes,
        "lower_bound_bytes": lower_bound_bytes(spec, old, new),
        "local_bytes": plan.local_bytes,
        "state_bytes": spec.state_bytes,
        "max_rank_send_bytes": max(sends.values(), default=0),
        "max_rank_recv_bytes": max(recvs.values(), default=0),
        "budget_bytes": budget,
        "rounds": len(schedule.rounds),
        "plan_seconds": round(plan_seconds, 4),
        "schedule_seconds": round(schedule_seconds, 4),
        "plan_hash": digest,
    }


def view_summary(
    spec: ModelSpec, old: Layout, new: Layout, member: str, lost: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The figures and pieces `liveshard plan --rank R --json` prints for one member."""
    view, seconds = _timed(plan_view, spec, old, new, member, lost)
    members = union_members(old, new, lost)

    def entries(items: Any, peer_of: str) -> list[dict[str, Any]]:
        out = []
        for ref, piece in items:
            box: Box = piece.box
            out.append(
                {
                    "tensor": spec.tensor_name(ref),
                    "peer": members[getattr(piece, peer_of)],
                    "box": [list(iv) for iv in box],
                    "bytes": volume(box) * spec.dtype(ref.kind).itemsize,
                }
            )
        return out

    local, sends, recvs = (
        entries(view.local, "src"),
        entries(view.sends, "dst"),
        entries(view.recvs, "src"),
    )
    return {
        "member": member,
        "old_rank": old.ranks.get(member),
        "new_rank": new.ranks.get(member),
        "plan_seconds": round(seconds, 4),
        "local_bytes": sum(e["bytes"] for e in local),
        "send_bytes": sum(e["bytes"] for e in sends),
        "recv_bytes": sum(e["bytes"] for e in recvs),
        "local": local,
        "sends": sends,
        "recvs": recvs,
    }


def _print_human(summary: dict[str, Any]) -> None:
    for key, value in summary.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            value = f"{len(value)} pieces"
        elif isinstance(value, list) and len(value) > 8:
            value = f"{len(value)} members: {', '.join(value[:4])}, ..., {value[-1]}"
        elif isinstance(value, list):
            value = ", ".join(value) or "none"
        print(f"{key}: {value}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liveshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compute the transfer plan between two layouts")
    plan.add_argument("--model", required=True, help="a preset name or a JSON/YAML model file")
    plan.add_argument(
        "--from", dest="old", required=True, help="old layout, e.g. tp=8,pp=8,dp=16,zero=1"
    )
    plan.add_argument("--to", dest="new", required=True, help="new layout")
    plan.add_argument("--drop", default="", help="comma-separated member numbers that leave")
    plan.add_argument("--add", type=int, default=None, help="number of members that join")
    plan.add_argument(
        "--lost", default="", help="comma-separated member numbers that died with their state"
    )
    plan.add_argument(
        "--replace", default="", help="comma-separated member numbers whose rank a new member takes"
    )
    plan.add_argument("--budget", default="1GiB", help="per-member buffer bytes per round")
    plan.add_argument("--rank", type=int, default=None, help="print this member's part only")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = resolve_model(args.model)
        change = MemberChange(
            drop=_int_list(args.drop, "--drop"), replace=_int_list(args.replace, "--replace"),
            lost=_int_list(args.lost, "--lost"), add=args.add,
        )  # fmt: skip
        old, new = apply_change(spec, parse_degrees(args.old), parse_degrees(args.new), change)
        lost_members = change.lost_members()
        budget = parse_bytes(args.budget)
        if args.rank is None:
            summary = plan_summary(spec, old, new, budget, lost_members)
        else:
            summary = view_summary(spec, old, new, str(args.rank), lost_members)
    except ValueError as err:
        print(f"liveshard: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        _print_human(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
