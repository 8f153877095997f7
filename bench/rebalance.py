"""Live rebalancing benchmark (DynMo's loop): a static pipeline partition against live
rebalancing and packing, on the same job in the same run, and what measuring costs costs.

1. Progressive freezing on pp = 4 (4 member processes, gloo, CPU): an 8-layer model trains
   `steps` steps while `--freeze` freezes its first layers in three waves, so the first stages'
   work shrinks and the last stage paces the step. Three runs of the same job: the static even
   partition; `--rebalance` (layers move to where the work is); `--rebalance --pack` (and the work
   fits on fewer stages: members are released). Per run: tokens per second over the whole run
   (the first step's start to the last step's end, pauses included), the rebalances with their
   predicted gain, pauses and partitions, the members released, the final loss (equal in all
   runs: rebalancing moves layers, not the math).
2. The same for a mixture of experts (`tiny-moe`-like, 8 layers, top-2 of 8 experts) on pp = 4,
   with one uneven first partition: what routing and the measured costs make of it.
3. The cost of measuring: the median step time of one process training the 8-layer model on
   pp = 1 with the layer clock on and with its stamps and marks turned into no-ops, blocks of
   steps alternating.

On 2 cores the absolute speed is the machine's (4 processes share 2 cores); compare the ratios.

    python bench/rebalance.py [--quick] [--out bench/results/rebalance.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from common import machine, write_json
from torch.distributed import TCPStore

from liveshard_agent.local.launcher import HOST, Driver, LocalJob, local_config
from liveshard_agent.runtime import costs as clock_module
from liveshard_agent.runtime.member import Member
from liveshard_core.job import TrainingSettings
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import parse_degrees

DENSE = {"name": "bench-dense-8", "vocab": 256, "hidden": 128, "layers": 8, "heads": 4,
         "kv_heads": 2, "head_dim": 32, "ffn": 384, "tied_embeddings": True}  # fmt: skip
MOE = {**DENSE, "name": "bench-moe-8", "experts": 8, "expert_ffn": 96, "top_k": 2}


def _model_file(fields: dict[str, Any], folder: str) -> str:
    path = Path(folder) / f"{fields['name']}.json"
    path.write_text(json.dumps(fields))
    return str(path)


def _job(
    model: str,
    layout: str,
    settings: TrainingSettings,
    rebalance: RebalanceSettings,
    device: str = "cpu",
) -> LocalJob:
    degrees = parse_degrees(layout)
    config = local_config(model, settings, device=device)
    return LocalJob(
        config=dataclasses.replace(config, rebalance=rebalance),
        nprocs=degrees.world_size, layout=degrees, switches=(),
    )  # fmt: skip


def run(
    model: str, layout: str, settings: TrainingSettings, rebalance: RebalanceSettings
) -> dict[str, Any]:
    """One job, timed from its first step's start to its end."""
    job = _job(model, layout, settings, rebalance)
    lines: list[dict[str, Any]] = []
    stamps: list[float] = []

    def emit(line: dict[str, Any]) -> None:
        lines.append(line)
        stamps.append(time.perf_counter())

    Driver(job, emit).run()
    steps = [(line, at) for line, at in zip(lines, stamps, strict=True) if line["event"] == "step"]
    first, first_at = steps[0]
    wall = steps[-1][1] - (first_at - first["step_seconds"])
    switches = [line for line in lines if line["event"] == "switch"]
    return {
        "tokens_per_second": round(len(steps) * settings.tokens_per_step / wall, 1),
        "wall_seconds": round(wall, 3),
        "final_loss": steps[-1][0]["loss"],
        "final_layout": steps[-1][0]["layout"],
        "final_imbalance": steps[-1][0].get("imbalance"),
        "switches": [
            {
                k: s.get(k)
                for k in (
                    "step",
                    "result",
                    "trigger",
                    "from",
                    "to",
                    "pause_seconds",
                    "predicted_step_seconds",
                    "predicted_pause_seconds",
                    "imbalance",
                    "released",
                )
            }
            for s in switches
        ],
        "members_released": sorted({m for s in switches for m in s.get("released", [])}),
    }


def compare(model: str, layout: str, settings: TrainingSettings, window: int) -> dict[str, Any]:
    """The same job static, rebalancing, and rebalancing with packing."""
    runs = {
        "static": run(model, layout, settings, RebalanceSettings()),
        "rebalance": run(model, layout, settings, RebalanceSettings(True, 0.1, window)),
        "rebalance_pack": run(model, layout, settings, RebalanceSettings(True, 0.1, window, True)),
    }
    static = runs["static"]["tokens_per_second"]
    for name in ("rebalance", "rebalance_pack"):
        runs[name]["speedup_over_static"] = round(runs[name]["tokens_per_second"] / static, 3)
        runs[name]["same_final_loss"] = runs[name]["final_loss"] == runs["static"]["final_loss"]
    return runs


# ---- 3: the cost of measuring ----


def _no_clock() -> dict[str, Any]:
    """Turn the layer clock's stamps and marks into no-ops; returns what to restore."""
    clock = clock_module.LayerClock
    saved = {name: getattr(clock, name) for name in
             ("begin", "boundary", "end", "backward_begin", "backward_end")}  # fmt: skip
    clock.begin = clock.end = clock.backward_begin = clock.backward_end = lambda self: None  # type: ignore[method-assign]
    clock.boundary = lambda self, x, index: x  # type: ignore[method-assign]
    return saved


def overhead(
    model: str,
    steps: int,
    blocks: int,
    device: str = "cpu",
    settings: TrainingSettings | None = None,
) -> dict[str, Any]:
    """Median step time of one member (one process, pp = 1) with the clock on and off, blocks
    of `steps` steps alternating, after one step of warm-up."""
    store = TCPStore(HOST, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    settings = dataclasses.replace(settings or TrainingSettings(), steps=1 << 20)
    job = _job(model, "dp=1", settings, RebalanceSettings(), device)
    member = Member(name="m0", spec=job.spec(), settings=job.settings, store=store,
                    device=torch.device(device))  # fmt: skip
    member.start(parse_degrees("dp=1").layout(member.spec, ["m0"]))
    losses = [member.train_step().loss]
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(blocks):
        for mode in ("on", "off"):
            saved = _no_clock() if mode == "off" else {}
            try:
                for _ in range(steps):
                    record = member.train_step()
                    times[mode].append(record.seconds)
                    losses.append(record.loss)
            finally:
                for name, fn in saved.items():
                    setattr(clock_module.LayerClock, name, fn)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"step_seconds_clock_on": round(on, 5), "step_seconds_clock_off": round(off, 5),
            "overhead": round(on / off - 1, 4), "steps_each": steps * blocks,
            "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--out", default="bench/results/rebalance.json")
    args = parser.parse_args(argv)
    steps = 24 if args.quick else 80
    waves = tuple((steps * k // 4, 2 * k) for k in (1, 2, 3))  # freeze 2, 4, then 6 of 8 layers
    window = 3 if args.quick else 5
    with tempfile.TemporaryDirectory(prefix="liveshard-rebalance-") as folder:
        dense, moe = _model_file(DENSE, folder), _model_file(MOE, folder)
        freezing = TrainingSettings(steps=steps, freeze=waves)
        out = {
            "machine": machine("torch CPU, gloo, 4 member processes"),
            "command": "python bench/rebalance.py" + (" --quick" if args.quick else ""),
            "freeze": {
                "model": DENSE,
                "layout": "pp=4",
                "freeze": [list(w) for w in waves],
                "runs": compare(dense, "pp=4", freezing, window),
            },
            "moe": {
                "model": MOE,
                "layout": "pp=4,pp_layers=1:1:2:4",
                "runs": compare(
                    moe, "pp=4,pp_layers=1:1:2:4", TrainingSettings(steps=steps), window
                ),
            },
            "measuring": overhead(dense, 12 if args.quick else 30, 2 if args.quick else 3),
        }
    write_json(args.out, out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
