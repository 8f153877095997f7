"""Sharded loading of a Hugging Face model: each member reads only its boxes.

Writes a random Llama-shaped model directory (safetensors shards of about 256 MiB, the names of
`liveshard_core.vps.hf`), then, for each layout, loads every member's initial state in a process
of its own (no world is needed to load) and reports its load time and peak resident memory
against the member's share of the parameters and the whole model's bytes. A peak close to the
share (plus the interpreter's and torch's own, measured in an empty run) and far below the model
is what sharded reading promises.

    python bench/load_pretrained.py [--hidden 1024 --layers 16 --vocab 32000] [--out F.json]
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
from safetensors.torch import save_file

from liveshard_agent.runtime.pretrained import load_pretrained
from liveshard_core.layout.layout import parse_degrees
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.spec import DType, ModelSpec


def write_model(directory: Path, hidden: int, layers: int, vocab: int) -> HfModel:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": hidden * 8 // 3 // 64 * 64, "num_hidden_layers": layers,
              "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 256,
              "torch_dtype": "float32"}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    model = HfModel.load(directory)
    spec = ModelSpec.from_config(model.config)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files, shard
        name = f"part-{files}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update(dict.fromkeys(shard, name))
        files, shard = files + 1, {}

    for param, sources in zip(spec.params, model.sources(spec), strict=True):
        for source in sources:
            shape = list(param.shape)
            shape[source.dim] = source.stop - source.start
            shard[source.name] = torch.randn(shape) * 0.02
            if sum(t.numel() * 4 for t in shard.values()) > 256 << 20:
                flush()
    if shard:
        flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


def member(directory: str, layout: str, rank: int) -> dict[str, Any]:
    """One member's load, in this process."""
    model = HfModel.load(directory)
    spec = ModelSpec.from_config(model.config)
    degrees = parse_degrees(layout)
    members = [f"m{i}" for i in range(degrees.world_size)]
    start = time.perf_counter()
    state = load_pretrained(model, spec, degrees.layout(spec, members), rank, torch.device("cpu"))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rank": rank, "seconds": round(seconds, 3), "state_bytes": state.nbytes,
            "peak_rss_bytes": peak}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layouts", default="dp=1;tp=4;pp=4;dp=4,zero=3;tp=2,pp=2")
    parser.add_argument("--out")
    parser.add_argument("--member", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member:
        directory, layout, rank = args.member
        print(json.dumps(member(directory, layout, int(rank))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp), args.hidden, args.layers, args.vocab)
        spec = ModelSpec.from_config(model.config)
        model_bytes = sum(prod(p.shape) for p in spec.params) * DType.FP32.itemsize
        empty = "import resource, torch, safetensors; print(resource.getrusage(0).ru_maxrss * 1024)"
        baseline = _run([sys.executable, "-c", empty])
        results = []
        for layout in args.layouts.split(";"):
            size = parse_degrees(layout).world_size
            ranks = [json.loads(_run([sys.executable, __file__, "--member", tmp, layout, str(r)]))
                     for r in range(size)]  # fmt: skip
            results.append({"layout": layout, "members": ranks})
            print(
                layout, [(r["seconds"], r["peak_rss_bytes"] >> 20) for r in ranks], file=sys.stderr
            )
    out = {
        "benchmark": "load_pretrained", "machine": machine(f"torch {torch.__version__}"),
        "command": "python bench/load_pretrained.py " + " ".join(sys.argv[1:]),
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "parameter_bytes_fp32": model_bytes},
        "interpreter_rss_bytes": int(baseline),
        "results": results,
    }  # fmt: skip
    print(json.dumps(out, indent=1))
    write_json(args.out, out)


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main()
