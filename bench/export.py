"""Export benchmark: `liveshard-export`'s time and peak memory on a checkpoint of a bigger model.

Writes a Llama-shaped Hugging Face directory (config.json only: hidden 1024, 8 layers, vocab
32000 by default, untied, about 150M parameters), trains it for one step from a random
initialisation with `liveshard-local` (2 processes, tp=2, bf16 parameters, so the checkpoint
holds bf16 parameters, their fp32 masters and both Adam moments: 14 bytes per parameter), then
exports that checkpoint in a fresh process per case and reports its wall time and peak resident
memory (`ru_maxrss` of that process). Cases: bf16 in one file (the default 5 GiB shard size),
bf16 and fp32 in 256 MiB shards. The peak is compared with the same interpreter after importing
the export module (`baseline_rss_bytes`) and with the largest logical tensor in its stored dtype
(the fp32 master of the embedding): streaming keeps the peak above the baseline to a few of
those, whatever the model's or the shard's size. Each export is checked against the plan: its
files hold every tensor, `total_size` bytes in all.

    python bench/export.py [--quick] [--hidden 1024 --layers 8 --vocab 32000] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from math import prod
from pathlib import Path
from typing import Any

import torch
from common import machine, write_json
from safetensors import safe_open

from liveshard_agent.export import export
from liveshard_core.cli import parse_bytes
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.spec import DType, ModelSpec

BIN = Path(sys.executable).parent
CASES = (("bf16", "5GiB"), ("bf16", "256MiB"), ("fp32", "256MiB"))


def write_config(directory: Path, hidden: int, layers: int, vocab: int) -> HfModel:
    directory.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": hidden * 8 // 3 // 64 * 64, "num_hidden_layers": layers,
              "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 256,
              "tie_word_embeddings": False, "dtype": "bfloat16"}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return HfModel.load(directory)


def train(model: Path, checkpoints: Path) -> Path:
    """One step from a random initialisation, checkpointed after it."""
    command = [str(BIN / "liveshard-local"), "--model", str(model), "--init", "random",
               "--nprocs", "2", "--layout", "tp=2", "--precision", "bf16", "--steps", "1",
               "--global-batch", "2", "--micro-batch", "1", "--seq-len", "32", "--json",
               "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"]  # fmt: skip
    _run(command)
    return checkpoints / "step-1"


def one_export(checkpoint: str, out: str, dtype: str, shard_size: str) -> dict[str, Any]:
    """One export, in this process (a fresh one), with its time and peak memory."""
    start = time.perf_counter()
    export(checkpoint, out, dtype, parse_bytes(shard_size, "shard size"))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": round(seconds, 3), "peak_rss_bytes": peak}


def check(out: Path, spec: ModelSpec, dtype: DType) -> tuple[int, int]:
    """(files, bytes of tensors) of an export; fails unless it holds every parameter's bytes."""
    files = sorted(out.glob("*.safetensors"))
    size = 0
    for path in files:
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                size += prod(handle.get_slice(name).get_shape()) * dtype.itemsize
    expected = sum(prod(p.shape) for p in spec.params) * dtype.itemsize
    if size != expected:
        raise SystemExit(f"{out}: {size} bytes of tensors, the model has {expected}")
    return len(files), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--quick", action="store_true", help="hidden 512, 2 layers, vocab 4000")
    parser.add_argument("--out")
    parser.add_argument("--export", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export:
        print(json.dumps(one_export(*args.export)))
        return
    if args.quick:
        args.hidden, args.layers, args.vocab = 512, 2, 4000
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = write_config(root / "model", args.hidden, args.layers, args.vocab)
        spec = ModelSpec.from_config(hf.config)
        start = time.perf_counter()
        checkpoint = train(root / "model", root / "checkpoints")
        train_seconds = time.perf_counter() - start
        stored = sum(p.stat().st_size for p in checkpoint.glob("*.distcp"))
        empty = ("import resource, liveshard_agent.export; "
                 "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")  # fmt: skip
        baseline = int(_run([sys.executable, "-c", empty]))
        results = []
        for k, (dtype, shard_size) in enumerate(CASES):
            out = root / f"export-{k}"
            command = [sys.executable, __file__, "--export", str(checkpoint), str(out), dtype,
                       shard_size]  # fmt: skip
            result = json.loads(_run(command))
            files, size = check(out, spec, DType(dtype))
            result |= {"dtype": dtype, "shard_size": shard_size, "files": files,
                       "tensor_bytes": size,
                       "peak_above_baseline_bytes": result["peak_rss_bytes"] - baseline,
                       "written_bytes_per_second": round(size / result["seconds"])}  # fmt: skip
            results.append(result)
            print(dtype, shard_size, result["seconds"], result["peak_rss_bytes"] >> 20,
                  file=sys.stderr)  # fmt: skip
    largest = max(prod(p.shape) for p in spec.params) * DType.FP32.itemsize
    report = {
        "benchmark": "export", "machine": machine(f"torch {torch.__version__}"),
        "command": "python bench/export.py " + " ".join(sys.argv[1:]),
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "parameters": sum(prod(p.shape) for p in spec.params),
                  "largest_tensor_fp32_bytes": largest},
        "checkpoint": {"layout": "tp=2", "precision": "bf16", "bytes": stored,
                       "train_seconds": round(train_seconds, 1)},
        "baseline_rss_bytes": baseline,
        "results": results,
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    write_json(args.out, report)


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip()


if __name__ == "__main__":
    main()
