"""`liveshard plan`: the transfer plan of a member change, its member assignment, and a dry run.

Members are numbered by their rank in the old layout, new members after the old ones. `--drop`
removes members, `--replace` gives a member's place to a new member, `--lost` drops members that
died with their state (the plan takes every byte from surviving copies, or fails naming a tensor
that has none), `--add` says how many new members join. `--assign best` (the default) lets the
survivors take the new ranks so that the fewest bytes cross the network, leaving surplus
survivors as spares; `--assign ordered` keeps them in their old order (`liveshard_core.members`
states both). `--predict` adds the predicted pause of the schedule (`plan.predict`).
`--members-per-pod N` puts members N to a pod in that numbering (a pod of N GPUs): the plan takes
each piece from a holder in the needer's pod when there is one, and the dry run costs the bytes
inside a pod at `--pod-bandwidth`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..layout.layout import Layout, parse_degrees
from ..members import Assign, Change, MemberChange, numbered_pods, resolve_change
from ..plan.bounds import lower_bound_bytes
from ..plan.matching import Piece
from ..plan.plan import Plan, build_plan, source_layout
from ..plan.predict import Links, predict
from ..plan.schedule import Op, Schedule, build_schedule, member_schedule, plan_traffic
from ..plan.union import Pods, union_members
from ..plan.view import plan_view
from ..vps.box import Box, volume
from ..vps.presets import resolve_model
from ..vps.spec import ModelSpec
from .common import int_list, parse_bytes, parse_rate, parse_seconds, timed


def add_parser(sub: Any) -> None:
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
        "--replace",
        default="",
        help="comma-separated members whose place a new member takes",
    )
    plan.add_argument(
        "--assign", choices=[a.value for a in Assign], default=Assign.BEST.value,
        help="best: survivors take the ranks that move the fewest bytes; ordered: in old order",
    )  # fmt: skip
    plan.add_argument("--budget", default="1GiB", help="per-member buffer bytes per round")
    plan.add_argument("--rank", type=int, default=None, help="print this member's part only")
    plan.add_argument("--predict", action="store_true", help="add the predicted pause")
    plan.add_argument("--bandwidth", default="25GB/s", help="one member's link, for --predict")
    plan.add_argument("--latency", default="1ms", help="time added to every round, for --predict")
    plan.add_argument(
        "--members-per-pod", type=int, default=1,
        help="members per pod (a pod of several GPUs), numbered in order: 0..N-1 share the first",
    )  # fmt: skip
    plan.add_argument(
        "--pod-bandwidth", default="450GB/s", help="one member's link inside its pod, for --predict"
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = resolve_model(args.model)
    member_change = MemberChange(
        drop=int_list(args.drop, "--drop"), replace=int_list(args.replace, "--replace"),
        lost=int_list(args.lost, "--lost"), add=args.add,
    )  # fmt: skip
    budget = parse_bytes(args.budget)
    bandwidth = parse_rate(args.bandwidth)
    latency = parse_seconds(args.latency, "--latency")
    change, seconds = timed(
        resolve_change, spec, parse_degrees(args.old), parse_degrees(args.new), member_change,
        Assign(args.assign), args.members_per_pod,
    )  # fmt: skip
    lost = member_change.lost_members()
    pods = numbered_pods([*change.old.members, *change.new.members], args.members_per_pod)
    if args.rank is not None:
        return view_summary(spec, change.old, change.new, str(args.rank), lost, budget, pods)
    summary, plan, schedule = plan_summary(
        spec, change.old, change.new, budget, lost, change, seconds, pods
    )
    if args.predict:
        links = Links(pods, parse_rate(args.pod_bandwidth, "--pod-bandwidth")) if pods else None
        summary.update(predict_summary(plan, schedule, bandwidth, latency, links))
    return summary


def plan_summary(
    spec: ModelSpec,
    old: Layout,
    new: Layout,
    budget: int,
    lost: frozenset[str] = frozenset(),
    change: Change | None = None,
    assign_seconds: float = 0.0,
    pods: Pods | None = None,
) -> tuple[dict[str, Any], Plan, Schedule]:
    """The figures `liveshard plan --json` prints for a whole plan, with the plan and schedule."""

    def plan_and_hash() -> tuple[Plan, str]:
        plan = build_plan(spec, old, new, lost, pods)
        return plan, plan.digest

    (plan, digest), plan_seconds = timed(plan_and_hash)
    schedule, schedule_seconds = timed(build_schedule, plan, budget)
    sends, recvs = plan.slot_bytes
    kept = set(new.members)
    out: dict[str, Any] = {
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
        # Of what the plan may read: a recovery from ZeRO-1 trusts only the shards' holders.
        "lower_bound_bytes": lower_bound_bytes(spec, source_layout(old, lost), new),
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
    if pods:
        out["across_pods_bytes"] = plan.across_pods_bytes()
    if change is not None:
        out.update(
            {
                "assign": change.assign.value,
                "members_to": list(change.chosen.members_to),
                "spares": list(change.spares),
                "best_network_bytes": change.best.network_bytes,
                "ordered_network_bytes": change.ordered.network_bytes,
                "assignment_lower_bound_bytes": change.best.lower_bound_bytes,
                "assign_seconds": round(assign_seconds, 4),
            }
        )
    return out, plan, schedule


def predict_summary(
    plan: Plan, schedule: Schedule, bandwidth: float, latency: float, links: Links | None = None
) -> dict[str, Any]:
    """The dry-run figures `--predict` adds."""
    prediction = predict(schedule, bandwidth, latency, links)
    members = plan.members
    return {
        "predicted_pause_seconds": round(prediction.pause_seconds, 6),
        "predicted_round_seconds": [round(s, 6) for s in prediction.round_seconds],
        "bandwidth_bytes_per_second": bandwidth,
        "round_latency_seconds": latency,
        "peak_buffer_bytes": prediction.peak_buffer_bytes,
        "member_send_bytes": {members[s]: n for s, n in sorted(prediction.send_bytes.items())},
        "member_recv_bytes": {members[s]: n for s, n in sorted(prediction.recv_bytes.items())},
    }


def view_summary(
    spec: ModelSpec,
    old: Layout,
    new: Layout,
    member: str,
    lost: frozenset[str],
    budget: int,
    pods: Pods | None = None,
) -> dict[str, Any]:
    """The figures, rounds and pieces `liveshard plan --rank R --json` prints for one member.
    The member's rounds need the plan's traffic, which agents unite by one all-reduce; here it
    comes from the whole plan (`plan_seconds` counts the member's own work only)."""
    view, seconds = timed(plan_view, spec, old, new, member, lost, pods)
    part = view.part
    traffic = plan_traffic(build_plan(spec, old, new, lost, pods))
    rounds = member_schedule(part, traffic, budget).slot_rounds(part.slot)
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
        "budget_bytes": budget,
        "rounds": len(rounds),
        "round_send_bytes": [_op_bytes(spec, ops, lambda p: p.src == part.slot) for ops in rounds],
        "round_recv_bytes": [_op_bytes(spec, ops, lambda p: p.dst == part.slot) for ops in rounds],
        "local": local,
        "sends": sends,
        "recvs": recvs,
    }


def _op_bytes(spec: ModelSpec, ops: list[Op], mine: Callable[[Piece], bool]) -> int:
    return sum(volume(p.box) * spec.dtype(ref.kind).itemsize for ref, p in ops if mine(p))
