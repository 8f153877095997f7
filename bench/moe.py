"""Mixture-of-experts step time: one member (one process, `liveshard-local --nprocs 1`) training
a top-k mixture of experts of 8, 64 and 128 experts (the same small dense part, 24 x 64 tokens a
step), the median step and tokens per second per model. The MoE layer's cost grows with the
experts a member runs (one matrix product per expert that received rows) and not with a host sync
or a copy of its output per expert; this benchmark shows how much.

    python bench/moe.py [--quick] [--device cpu|cuda] [--out bench/results/moe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import machine, write_json

DENSE = {"vocab": 256, "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32,
         "ffn": 256, "expert_ffn": 64, "qk_norm": True}  # fmt: skip
MODELS = [(8, 2), (64, 4), (128, 8)]  # (experts, top_k)
FIRST = 2  # steps left out of the median: the first ones warm the allocator and the caches


def run(experts: int, top_k: int, steps: int, device: str, folder: str) -> dict[str, Any]:
    """One member training the model with `experts` experts for `steps` steps."""
    model = Path(folder, f"moe-{experts}.json")
    model.write_text(json.dumps({"name": f"moe-{experts}", "experts": experts, "top_k": top_k,
                                 **DENSE}))  # fmt: skip
    command = [
        sys.executable, "-m", "liveshard_agent.local.launcher", "--model", str(model),
        "--nprocs", "1", "--steps", str(steps), "--device", device, "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    records = [r for r in records if r.get("event") == "step"]
    seconds = statistics.median(r["step_seconds"] for r in records[FIRST:])
    return {
        "experts": experts, "top_k": top_k, "steps": len(records),
        "step_seconds": round(seconds, 4),
        "tokens_per_second": round(records[-1]["tokens"] / seconds, 1),
        "last_loss": records[-1]["loss"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest model, a few steps")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default="bench/results/moe.json")
    args = parser.parse_args(argv)
    models, steps = (MODELS[:1], FIRST + 2) if args.quick else (MODELS, FIRST + 10)
    what = torch.cuda.get_device_name() if args.device == "cuda" else "one torch thread"
    with tempfile.TemporaryDirectory(prefix="liveshard-moe-") as folder:
        rows = [run(e, k, steps, args.device, folder) for e, k in models]
    out = {
        "machine": machine(f"{what}, torch {torch.__version__}"),
        "command": "python bench/moe.py" + (" --quick" if args.quick else "")
        + ("" if args.device == "cpu" else f" --device {args.device}"),
        "dense": DENSE,
        "models": rows,
    }  # fmt: skip
    write_json(args.out, out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
