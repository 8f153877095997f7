"""What a mirrored layout (`Layout.mirror`, a job's `faultTolerance.snapshots`: ZeRO shards
mirrored in their group, boxes without replicas copied by a peer) costs and what it buys, on local
jobs of 4 processes (`liveshard-local`, gloo on CPU), in `--layout` (default `dp=4,zero=1`):
- memory: the state bytes each member holds, with and without the mirror (exact, from the
  layout's regions);
- step time: the median step of the same job with and without the mirror, runs alternated (4
  processes share this machine's cores, so a run's median moves by 10-20 % from run to run), and
  what the mirror adds to it directly: one member's optimizer update (its copies' too), timed
  alone, and the peers' gradient exchange, timed inside every step of the mirrored runs (rank
  0's `exchange_seconds`); their sum over the median step is the mirror's cost per step;
- a member killed without notice: from its death to the next step trained, recovered in memory
  from the mirrors, against the same job without them restarting from its last checkpoint (saved
  every `CHECKPOINT_EVERY` steps), and the steps each trains again; and killed after its update,
  before ZeRO-1 shares it (in memory too, the step kept).

    python bench/snapshots.py [--quick] [--layout DEGREES] [--out bench/results/snapshots.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from common import machine, write_json

from liveshard_agent.engine.state import region_boxes
from liveshard_agent.runtime.optimizer import Optimizer
from liveshard_agent.runtime.trainer import initial_state
from liveshard_agent.runtime.weights import Weights
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.vps.box import box_shape, volume
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import DType, ModelSpec

MODEL = "qwen3-tiny"
LAYOUT = "dp=4,zero=1"
KILL_STEP, CHECKPOINT_EVERY = 12, 5
FIRST = 3  # steps left out of the median: the first ones warm the allocator and the caches


def launch(layout: str, steps: int, *extra: str) -> list[tuple[float, dict[str, Any]]]:
    """The job's JSON lines, each with the time it was read (`time.perf_counter()`)."""
    command = [
        sys.executable, "-m", "liveshard_agent.local.launcher", "--model", MODEL, "--nprocs", "4",
        "--layout", layout, "--steps", str(steps), "--json", *extra,
    ]  # fmt: skip
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("{"):
                lines.append((time.perf_counter(), json.loads(line)))
        err = p.stderr.read() if p.stderr else ""
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{err[-3000:]}")
    return lines


def median_step(layout: str, steps: int) -> tuple[float, float]:
    """The median step's seconds and the median of its peers' gradient exchange."""
    records = [r for _, r in launch(layout, steps) if r["event"] == "step"][FIRST:]
    return (statistics.median(r["step_seconds"] for r in records),
            statistics.median(r["exchange_seconds"] for r in records))  # fmt: skip


def model() -> ModelSpec:
    """The model as the local job's members build it on CPU: fp32, without a master copy."""
    config = resolve_model(MODEL).config
    return ModelSpec.from_config(dataclasses.replace(config, param_dtype=DType.FP32))


def placed(layout: str) -> Layout:
    return parse_degrees(layout).layout(model(), [str(i) for i in range(4)])


@torch.no_grad()
def update_seconds(layout: str, repeat: int = 20) -> float:
    """The fastest of `repeat` AdamW updates of rank 1's shards (its mirror's and the copies it
    holds for a peer too) from given gradients, in this process (no collective), on one torch
    thread as each member here."""
    torch.set_num_threads(1)
    state = initial_state(model(), placed(layout), 1, 0, torch.device("cpu"))
    weights = Weights.build(state, world=None)  # type: ignore[arg-type]  # no collective here
    optimizer = Optimizer(weights, TrainingSettings())
    grads = {w.name: [torch.randn_like(t) for t in w.tensors] for w in weights.all()}
    copies = [(p, box, torch.randn(box_shape(box))) for p, box in weights.peers.held()]
    fastest = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        optimizer.adam(weights.all(), grads, 0.5, 1e-3, 3, copies)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def member_bytes(layout: str) -> int:
    """The state bytes of the member that holds the most."""
    spec = model()
    placed_ = placed(layout)
    return max(
        sum(volume(b) * spec.dtype(ref.kind).itemsize for ref, boxes in
            region_boxes(spec, placed_, rank).items() for b in boxes)
        for rank in range(placed_.world_size)
    )  # fmt: skip


def death(layout: str, steps: int, *extra: str, phase: str = "step") -> dict[str, Any]:
    """Kill rank 1 at `phase` of `KILL_STEP` (as it begins; `update`: after its update, before
    ZeRO-1 shares it): the seconds from its death (the launcher's `lost` line) to the next step
    trained, the recovery's bytes, and the steps trained again."""
    lines = launch(layout, steps, "--kill", f"{KILL_STEP}:1:{phase}", *extra)
    lost = next(t for t, r in lines if r["event"] == "lost")
    after = [(t, r) for t, r in lines if t > lost and r["event"] == "step"]
    resumed, first = after[0]
    trained = [r["step"] for _, r in lines if r["event"] == "step"]
    restored = any(r["event"] == "restored" for _, r in lines)
    # In memory, the recovery is a switch naming the lost member (a restore starts new processes).
    switch = next((r for _, r in lines if r["event"] == "switch" and r.get("lost")), {})
    return {
        "death_to_next_step_seconds": round(resumed - lost, 3),
        "recovery": "checkpoint restore" if restored else "in memory",
        "recovery_switch_seconds": switch.get("switch_seconds"),
        "recovery_network_bytes": switch.get("network_bytes"),
        "resumed_at_step": first["step"],
        "steps_trained_again": len(trained) - len(set(trained)),
        "losses_after": [round(r["loss"], 6) for _, r in after[:3]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, one each")
    parser.add_argument("--layout", default=LAYOUT, help="degrees of 4 ranks, without mirror")
    parser.add_argument("--out", default="bench/results/snapshots.json")
    args = parser.parse_args(argv)
    steps, repeats = (FIRST + 4, 1) if args.quick else (FIRST + 25, 5)
    layout = args.layout
    mirrored = f"{layout},mirror=1"
    times: dict[str, list[float]] = {layout: [], mirrored: []}
    exchanges: list[float] = []
    for _ in range(repeats):  # alternated, so that the machine's drift hits both alike
        for degrees in times:
            seconds, exchange = median_step(degrees, steps)
            times[degrees].append(seconds)
            if degrees == mirrored:
                exchanges.append(exchange)
    base, mirror = statistics.median(times[layout]), statistics.median(times[mirrored])
    updates = {"held once": update_seconds(layout), "mirrored": update_seconds(mirrored)}
    exchange = statistics.median(exchanges)
    added = exchange + updates["mirrored"] - updates["held once"]
    end = KILL_STEP + 4
    with tempfile.TemporaryDirectory(prefix="liveshard-snapshots-") as folder:
        restart = death(layout, end, "--checkpoint-dir", folder,
                        "--checkpoint-every", str(CHECKPOINT_EVERY))  # fmt: skip
    out = {
        "machine": machine(f"4 processes, gloo, torch {torch.__version__}"),
        "command": " ".join(["python bench/snapshots.py", *(argv or sys.argv[1:])]),
        "model": MODEL, "layout": layout,
        "member_state_bytes": {"held once": member_bytes(layout),
                               "mirrored": member_bytes(mirrored)},
        "step_seconds": {"held once": round(base, 4), "mirrored": round(mirror, 4),
                         "runs": {k: [round(v, 4) for v in vs] for k, vs in times.items()}},
        "step_overhead": round(mirror / base - 1, 4),
        "optimizer_update_seconds": {k: round(v, 5) for k, v in updates.items()},
        "exchange_seconds": round(exchange, 5),
        "mirror_seconds_per_step": round(added, 5),
        "mirror_cost_per_step": round(added / base, 4),
        "member_killed": {"mirrored": death(mirrored, end),
                          "mirrored, after its update, before sharing it":
                              death(mirrored, end, phase="update"),
                          f"held once, checkpoint every {CHECKPOINT_EVERY} steps": restart},
    }  # fmt: skip
    write_json(args.out, out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
