"""`liveshard layout`: the layout to use for a number of members, its spares and why.

A thin front to `policy.layout.choose_layout`, which the operator calls too.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..layout.layout import parse_degrees
from ..members import old_members
from ..policy.layout import Constraints, choose_layout
from ..policy.model import Hardware
from ..vps.presets import resolve_model
from .common import parse_bytes, parse_rate, timed


def add_parser(sub: Any) -> None:
    p = sub.add_parser("layout", help="choose the layout for a number of members")
    p.add_argument("--model", required=True, help="a preset name or a JSON/YAML model file")
    p.add_argument("--members", type=int, required=True, help="members available")
    p.add_argument("--tp", type=int, default=None, help="fix tp (default: free, up to 8)")
    p.add_argument("--pp-max", type=int, default=None, help="at most this many stages")
    p.add_argument("--ep", type=int, default=None, help="fix ep (default: free for MoE)")
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage: 0, 1 or 3 (default 1)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--device-memory", default="80GiB", help="memory per device")
    p.add_argument("--device-flops", type=float, default=989e12, help="peak FLOP/s per device")
    p.add_argument("--bandwidth", default="25GB/s", help="network per device")
    p.add_argument("--tp-bandwidth", default="450GB/s", help="link inside a node (tp)")
    p.add_argument(
        "--tolerance", type=float, default=0.02,
        help="with --from: step times this close to the best count as equal",
    )  # fmt: skip
    p.add_argument("--from", dest="current", default=None, help="the current layout")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = resolve_model(args.model)
    constraints = Constraints(
        tp=args.tp, pp_max=args.pp_max, ep=args.ep, zero=args.zero,
        global_batch=args.global_batch, micro_batch=args.micro_batch, seq_len=args.seq_len,
        tolerance=args.tolerance,
    )  # fmt: skip
    hardware = Hardware(
        memory=parse_bytes(args.device_memory, "--device-memory"), flops=args.device_flops,
        network_bandwidth=parse_rate(args.bandwidth, "--bandwidth"),
        tp_bandwidth=parse_rate(args.tp_bandwidth, "--tp-bandwidth"),
    )  # fmt: skip
    current = None
    if args.current is not None:
        degrees = parse_degrees(args.current)
        current = degrees.layout(spec, old_members(degrees.world_size))
    choice, seconds = timed(choose_layout, spec, args.members, constraints, hardware, current)
    d = choice.degrees
    out: dict[str, Any] = {
        "model": spec.config.name,
        "members": args.members,
        "layout": choice.describe(),
        "dp": d.dp,
        "tp": d.tp,
        "pp": d.pp,
        "ep": d.ep,
        "zero": d.zero,
        "pp_layers": list(d.pp_layers or ()),
        "ranks": d.world_size,
        "spares": list(choice.spares),
        "step_seconds": round(choice.estimate.step_seconds, 6),
        "step_parts_seconds": {k: round(v, 6) for k, v in choice.estimate.step_parts.items()},
        "memory_bytes": choice.estimate.memory,
        "memory_parts_bytes": choice.estimate.memory_parts,
        "device_memory_bytes": hardware.memory,
        "candidates": choice.candidates,
        "why": list(choice.why),
        "policy_seconds": round(seconds, 4),
    }
    if current is not None:
        out["from"] = current.describe()
        out["bytes_to_move"] = choice.bytes_to_move
        out["members_to"] = list(choice.members_to or ())
    return out
