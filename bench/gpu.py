"""One GPU: bf16 training throughput and MFU, what timing the layers costs on CUDA events, and a
switch of the same job's state on the device, in each memory mode: its pause and the device
memory it really takes, against the device's copy bandwidth and a checkpoint save + load.

In one run, on one GPU:

1. The limits, measured here: a device-to-device copy, pinned host-to-device and device-to-host
   copies (GB/s of bytes copied), and a square bf16 matrix product (TFLOP/s).
2. One member (one process, dp = 1) training a Llama-shaped model in bf16 with its fp32 master
   copy and Adam: the median step time with the layer clock on and off (blocks of steps
   alternating, `rebalance.overhead`), tokens per second, and the model FLOPs utilisation
   (6 x the parameters a token multiplies by, plus attention, per token) against the measured
   matrix rate and against the card's datasheet peak.
3. The same model's full training state (parameters, master, Adam moments) seeded on the device
   and switched from dp=1 to dp=1,zero=3 by one member, resident and bounded: NCCL wants one GPU
   per rank, so every byte stays local (copied on the device, or passed on whole after the host
   copy). The pause and the bytes per second against the copy limits; the allocator's peak
   above the old state, from before prepare to after the switch, against the switch's own
   account (`peak_extra_bytes`). The bounded switch runs twice: its prepare allocates pinned
   host memory, which torch's host allocator keeps for the next.
4. What users do instead: the same state saved as a checkpoint (torch.distributed.checkpoint,
   local disk) and loaded back (process restart not counted).

Transfers between GPUs (NCCL across ranks) stay unmeasured on one GPU.

    python bench/gpu.py [--quick] [--device cuda] [--out bench/results/gpu.json]

`--device cpu --quick` is a smoke run of the script itself (no limits, no memory figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import best, machine, write_json
from rebalance import _model_file, overhead
from torch.distributed import HashStore

from liveshard_agent.engine.state import ShardedState
from liveshard_agent.engine.switch import MemoryMode, Reconfiguration
from liveshard_agent.engine.world import wait_closed
from liveshard_agent.local.launcher import local_config
from liveshard_agent.runtime import checkpoint
from liveshard_agent.runtime.trainer import Scalars
from liveshard_core.job import Deadlines, TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from liveshard_core.vps.spec import ModelSpec

# About 0.8 B parameters: Llama-shaped, grouped-query attention, untied head.
MODEL = {"name": "bench-gpu-0.8b", "vocab": 32000, "hidden": 2048, "layers": 16, "heads": 16,
         "kv_heads": 8, "head_dim": 128, "ffn": 5632}  # fmt: skip
QUICK = {**MODEL, "name": "bench-gpu-quick", "vocab": 512, "hidden": 128, "layers": 4,
         "heads": 4, "kv_heads": 2, "head_dim": 32, "ffn": 384}  # fmt: skip
DATASHEET_BF16 = 989e12  # dense bf16 FLOP/s of an H100 or H200 SXM, the vendor's figure
GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _seconds(fn: Callable[[], Any], device: torch.device, repeat: int = 5) -> float:
    """The fastest of `repeat` calls (after one of warm-up), the device synchronised after each."""

    def synced() -> None:
        fn()
        _sync(device)

    _sync(device)
    return best(synced, repeat + 1)[1]


def limits(device: torch.device, quick: bool) -> dict[str, float]:
    n = (64 << 20) if quick else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = {"copy_bytes": n, "device_copy_gb_s": n / _seconds(lambda: dst.copy_(src), device) / GB}
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out["to_host_gb_s"] = n / _seconds(lambda: host.copy_(src), device) / GB
        out["from_host_gb_s"] = n / _seconds(lambda: src.copy_(host), device) / GB
    m = 1024 if quick else 8192
    a, b = (torch.randn(m, m, device=device, dtype=torch.bfloat16) for _ in range(2))
    out["bf16_matmul_tflop_s"] = 2 * m**3 / _seconds(lambda: a @ b, device) / 1e12
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the parameters a token multiplies by (every matrix but the
    input embedding's lookup; the head's, tied or not) plus attention's scores and values,
    6 x layers x seq_len x heads x head_dim x 2 (forward 2, backward 4)."""
    cfg = spec.config
    matmul = sum(math.prod(p.shape) for p in spec.params if p.name != "embed")
    if cfg.tied_embeddings:
        matmul += cfg.vocab * cfg.hidden
    return 6 * matmul + 12 * cfg.layers * seq_len * cfg.heads * cfg.head_dim


def training(model: str, settings: TrainingSettings, device: torch.device, quick: bool,
             matmul_tflop_s: float) -> dict[str, Any]:  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = overhead(model, 3 if quick else 15, 2, device.type, settings)
    spec = local_config(model, settings, device=device.type).model_spec(device.type)
    tokens = settings.tokens_per_step / result["step_seconds_clock_on"]
    flops = flops_per_token(spec, settings.seq_len) * tokens
    result.update(
        tokens_per_step=settings.tokens_per_step,
        tokens_per_second=round(tokens, 1),
        model_tflop_s=round(flops / 1e12, 1),
        mfu_of_measured_matmul=round(flops / (matmul_tflop_s * 1e12), 4),
        mfu_of_datasheet=round(flops / DATASHEET_BF16, 4),
        param_dtype=spec.config.param_dtype.value,
        params=sum(math.prod(p.shape) for p in spec.params),
    )
    if device.type == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    return result


def switch(spec: ModelSpec, device: torch.device, mode: MemoryMode, budget: int,
           limit: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    old = parse_degrees("dp=1").layout(spec, ["m0"])
    new = parse_degrees("dp=1,zero=3").layout(spec, ["m0"])
    reconfig = Reconfiguration(
        spec=spec, old=old, new=new, member="m0", store=HashStore(), epoch=1, device=device,
        budget=budget, deadlines=Deadlines(120, 300, 600), memory=mode,
    )  # fmt: skip
    state = ShardedState.seeded(spec, old, 0, 3, device)
    nbytes = state.nbytes
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    start = time.perf_counter()
    reconfig.prepare()  # the resident mode's shadow, the bounded mode's pinned host copy
    prepare = time.perf_counter() - start
    result = reconfig.switch(state)
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    if not result.committed or result.state is None:
        raise RuntimeError(f"the {mode.value} switch aborted: {result.reason}")
    record = result.record
    out: dict[str, Any] = {
        "state_bytes": nbytes,
        "prepare_seconds": round(prepare, 4),
        "pause_seconds": round(record.pause_seconds, 4),
        "seconds": {k: round(v, 4) for k, v in record.seconds.items()},
        "state_gb_s_in_pause": round(nbytes / record.pause_seconds / GB, 1),
        "peak_extra_bytes_accounted": record.peak_extra_bytes,
        "kept_bytes": record.kept_bytes,
        "host_bytes": record.host_bytes,
        "exact": result.state.matches_seed(3) == [],
    }
    if peak is not None:
        out["peak_extra_bytes_allocator"] = peak
        # What the pause cannot beat: one device copy of the state (resident), one copy of it
        # to the host (bounded).
        rate = limit["device_copy_gb_s" if mode is MemoryMode.RESIDENT else "to_host_gb_s"]
        out["limit_seconds"] = round(nbytes / (rate * GB), 4)
    del state, result
    _free(device)
    return out


def saved_and_loaded(spec: ModelSpec, settings: TrainingSettings, device: torch.device,
                     folder: str) -> dict[str, Any]:  # fmt: skip
    layout = parse_degrees("dp=1").layout(spec, ["m0"])
    state = ShardedState.seeded(spec, layout, 0, 3, device)
    store = HashStore()
    target = f"{folder}/step-0"
    start = time.perf_counter()
    checkpoint.save(state, Scalars(), settings, target, store=store, prefix="save")
    save = time.perf_counter() - start
    del state
    _free(device)
    start = time.perf_counter()
    loaded, _ = checkpoint.load(spec, layout, 0, device, target, store=store, prefix="load")
    _sync(device)
    load = time.perf_counter() - start
    exact = loaded.matches_seed(3) == []
    del loaded
    _free(device)
    return {"save_seconds": round(save, 3), "load_seconds": round(load, 3),
            "save_and_load_seconds": round(save + load, 3), "exact": exact}  # fmt: skip


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (a smoke run)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default="bench/results/gpu.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device (use --device cpu --quick for a smoke run)")
        return 2
    settings = TrainingSettings(
        global_batch=4 if args.quick else 8, micro_batch=2 if args.quick else 4,
        seq_len=128 if args.quick else 2048, warmup_steps=5, lr=3e-4,
    )  # fmt: skip
    name = (
        torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    ) + f", torch {torch.__version__}"
    with tempfile.TemporaryDirectory(prefix="liveshard-gpu-") as folder:
        model = _model_file(QUICK if args.quick else MODEL, folder)
        limit = limits(device, args.quick)
        out: dict[str, Any] = {
            "machine": machine(name),
            "command": "python bench/gpu.py"
            + (" --quick" if args.quick else "")
            + ("" if args.device == "cuda" else f" --device {args.device}"),
            "model": QUICK if args.quick else MODEL,
            "limits": limit,
            "training": training(model, settings, device, args.quick, limit["bf16_matmul_tflop_s"]),
        }
        _free(device)
        spec = local_config(model, settings, device="cuda").model_spec("cuda")  # bf16 + master
        out["switch"] = {
            mode.value: switch(spec, device, mode, 256 << 20, limit) for mode in MemoryMode
        }
        # The first switch of a process loads the collectives' kernels; pinned host memory is
        # slow to allocate, and torch's host allocator keeps it for the next.
        for mode in MemoryMode:
            out["switch"][f"{mode.value}_again"] = switch(spec, device, mode, 256 << 20, limit)
        out["checkpoint"] = saved_and_loaded(spec, settings, device, folder)
    pause = out["switch"]["resident"]["pause_seconds"]
    out["checkpoint"]["save_and_load_over_resident_pause"] = round(
        out["checkpoint"]["save_and_load_seconds"] / pause, 1
    )
    write_json(args.out, out)
    print(json.dumps(out, indent=1))
    wait_closed(60)  # a group still closing at exit aborts the interpreter
    return 0


if __name__ == "__main__":
    sys.exit(main())
