"""`liveshard rebalance`: a pipeline partition from measured layer costs, and packing.

The costs file is JSON (or YAML) with per-layer forward+backward seconds and, optionally,
per-layer bytes per device and the embedding's and head's share:

    {"layer_seconds": [0.011, 0.012, ...], "layer_bytes": [...],
     "first_seconds": 0.004, "last_seconds": 0.009, "first_bytes": 0, "last_bytes": 0}

Without `layer_bytes`, a layer's bytes are its training state per device under the current
layout (`policy.model`: parameters, gradients and optimizer state), so `--memory-cap` still
applies. The plan's bytes are those of the best member assignment (which equal the plan's network
bytes); with `--pack` the members of the stages given up are released as spares.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from ..assign.assign import Problem
from ..errors import InvalidInput
from ..layout.layout import Layout, parse_degrees
from ..members import old_members
from ..policy.model import state_bytes_per_layer
from ..policy.pipeline import LayerCosts, balance, evaluate, pack
from ..vps.presets import resolve_model
from ..vps.spec import ModelSpec
from .common import parse_bytes, timed

_KEYS = ("layer_seconds", "layer_bytes", "first_seconds", "last_seconds", "first_bytes",
         "last_bytes")  # fmt: skip


def add_parser(sub: Any) -> None:
    p = sub.add_parser("rebalance", help="repartition pipeline stages from layer costs")
    p.add_argument("--model", required=True, help="a preset name or a JSON/YAML model file")
    p.add_argument("--from", dest="current", required=True, help="the current layout")
    p.add_argument("--costs", required=True, help="JSON/YAML file of per-layer costs")
    p.add_argument("--memory-cap", default=None, help="bytes per device a stage may hold")
    p.add_argument("--pack", action="store_true", help="use the fewest stages within tolerance")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="--pack: slowest stage at most this much above today's")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


def load_costs(path: Path, spec: ModelSpec, layout: Layout) -> LayerCosts:
    """Read a costs file; missing bytes default to the state per device of each layer."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise InvalidInput(f"cannot read costs file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise InvalidInput(f"{path}: not valid JSON or YAML: {err}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a mapping with keys {list(_KEYS)}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown or "layer_seconds" not in data:
        raise InvalidInput(
            f"{path}: unknown keys {unknown} or no layer_seconds; valid keys: {list(_KEYS)}"
        )
    seconds = data["layer_seconds"]
    if not isinstance(seconds, list) or len(seconds) != spec.config.layers:
        raise InvalidInput(
            f"{path}: layer_seconds must list the {spec.config.layers} layers of {spec.config.name}"
        )
    try:
        values = {k: data[k] for k in _KEYS if k in data and k != "layer_bytes"}
        layer_bytes = tuple(int(b) for b in data.get("layer_bytes") or ())
        if not layer_bytes:
            layer_bytes, first, last = state_bytes_per_layer(spec, layout)
            values.setdefault("first_bytes", first)
            values.setdefault("last_bytes", last)
        return LayerCosts(
            seconds=tuple(float(s) for s in seconds), bytes=layer_bytes,
            first_seconds=float(values.get("first_seconds", 0.0)),
            last_seconds=float(values.get("last_seconds", 0.0)),
            first_bytes=int(values.get("first_bytes", 0)),
            last_bytes=int(values.get("last_bytes", 0)),
        )  # fmt: skip
    except (TypeError, ValueError) as err:
        raise InvalidInput(f"{path}: {err}") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = resolve_model(args.model)
    degrees = parse_degrees(args.current)
    old = degrees.layout(spec, old_members(degrees.world_size))
    costs = load_costs(Path(args.costs), spec, old)
    cap = None if args.memory_cap is None else parse_bytes(args.memory_cap, "--memory-cap")
    before = evaluate(costs, old.pp_layers)
    if args.pack:
        after, seconds = timed(pack, costs, old.pp_layers, args.tolerance, cap)
    else:
        after, seconds = timed(balance, costs, old.pp, cap, old.pp_layers)
    new = old.degrees.repartitioned(after.pp_layers)
    new.layout(spec, old_members(new.world_size))  # checks the new layout is feasible
    survivors = list(range(old.world_size))
    assignment = Problem(spec, old, new).best(survivors, 0)
    return {
        "model": spec.config.name,
        "from": old.describe(),
        "to": new.layout(spec, old_members(new.world_size)).describe(),
        "pp_layers_before": list(before.pp_layers),
        "pp_layers": list(after.pp_layers),
        "stage_seconds_before": [round(s, 9) for s in before.stage_seconds],
        "stage_seconds": [round(s, 9) for s in after.stage_seconds],
        "max_stage_seconds_before": round(before.max_seconds, 9),
        "max_stage_seconds": round(after.max_seconds, 9),
        "speedup": round(before.max_seconds / after.max_seconds, 4) if after.max_seconds else None,
        "stage_bytes": list(after.stage_bytes),
        "memory_cap_bytes": cap,
        "members_released": list(assignment.spares),
        "members_to": list(assignment.members_to),
        "network_bytes": assignment.network_bytes,
        "rebalance_seconds": round(seconds, 4),
    }
