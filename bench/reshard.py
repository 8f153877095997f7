"""Resharding benchmark: a live switch against the raw transport and against checkpoint/restart.

On this machine, with 4 worker processes (gloo over loopback, CPU tensors), it runs three layout
transitions of a dense model of about 1 GiB of training state (bf16 parameters plus fp32 master
and two Adam moments, 14 bytes per parameter): a dp change (2 -> 4 members join), a tp change
(tp 2 -> 4) and a pp change with a member removed (pp 2 -> 3, 4 -> 3 members). For each it
measures, in the same run and on the same processes:

- the live switch (`Reconfiguration`): `prepare` (plan, schedule, digest agreement, groups; in
  the background in a real job, so not part of the pause), then `switch`, the whole pause, whose
  wall time is taken as the maximum over ranks after a barrier. It checks the moved bytes
  (`Verification.MOVED`, the default). `transfer_seconds` is the `transfer` part (every round of
  sends and receives into the shadow that prepare allocated, checksummed as they go, with the
  local copies overlapping the first round); the rest of the pause is the vote (mostly waiting
  for the slowest member). `round_overhead_seconds` is the pause minus the raw transport time of
  the same bytes, divided by the schedule's rounds. `unverified_*` repeat the switch with
  `verify=False` (no checksums); `bounded_*` with the bounded memory mode (`MemoryMode.BOUNDED`:
  the old state copied to host memory at the switch, its device storage given back as the
  transfer goes, the shadow allocated as it is filled). `local_copy_seconds` times the plan's
  local copies alone, on the side, into a fresh scratch state. Each switch must commit, send
  exactly the plan's network bytes, and leave every new rank's state equal to the seeded
  expectation, or the run fails.
- the raw transport limit: for every (src, dst) pair of the plan, one contiguous uint8 buffer of
  that pair's total network bytes, all posted at once with plain `send`/`recv` on a
  ProcessGroupGloo over the same 4 processes, wait all; receive buffers are allocated and touched
  beforehand, so this is transport only (no planning, no copies, no page faults). Its time is the
  maximum over ranks, best of 3. `raw_transport_fresh_buffers_seconds` is the same with receive
  buffers allocated inside the timed part, as the switch's shadow is: first-touch page faults
  included, which on this machine costs about as much as the transport itself.
- the alternative users have today: `torch.distributed.checkpoint` (DCP) save of the old layout
  from the old processes (default gloo group over the old members, already initialised, so not
  timed), then fresh processes for the new layout, timed from before the spawn to the end of the
  load: process start, `import torch` and the rest of the imports, process-group init (a TCP
  store hosted by the driver, as a rendezvous service would), allocating the new state, and a DCP
  load that reshards into it. The loaded state is checked against the seeded expectation. The
  checkpoint goes to a temporary directory on /dev/shm when it has room (else the system temp
  dir) and is deleted afterwards: memory-speed storage and a bare process spawn (no container,
  scheduler or CUDA start) make this the comparator's best case. DCP's object collectives call
  `Tensor.numpy()`, so this benchmark needs numpy (in the `agent` extra).

Switch and checkpoint/restart are repeated (`--repeat`, default 2; 1 with --quick), each time
from a freshly seeded old state, and the best of each is reported.

How DCP reshards arbitrary boxes: every logical tensor becomes a `ShardedTensor` built with
`ShardedTensor._init_from_local_shards_and_global_metadata` (no collective, metadata computed on
each rank from the layout). For the save, the global metadata is the old layout's partition
(disjoint boxes), each box placed on its designated (first) holder, which saves it. For the load,
each new rank needs all of its boxes, replicas included, and a ShardedTensor's metadata must be
non-overlapping and cover the tensor: so each rank builds its own metadata from the new layout's
partition, placing a box on itself when it holds it and on its first holder otherwise. The
metadata therefore differs between ranks in which rank a replicated box is placed on; DCP's load
plans from each rank's local shards only, so each rank reads exactly the boxes it holds, with
DCP's own chunk intersection doing the resharding. The public `init_from_local_shards` cannot
be used for the load: it all-gathers the shards' metadata and rejects overlapping replicas.

Reported per transition (one JSON object per line, all written to --out when given): the plan,
byte counts, times, bandwidths, their ratios to the targets (the switch's transfer reaches at
least 80% of the raw transport's bandwidth; the switch is at least 20x faster than
checkpoint/restart), and memory above the steady state: `peak_extra_bytes` is the maximum over
ranks of `Memory.peak_extra` (shadow plus buffers in flight, minus old storage given back) in the
resident mode, `bounded_peak_extra_bytes` the same in the bounded mode (with
`bounded_within_budget_plus_growth`: whether every member stayed within the budget plus its own
growth), `rss_peak_extra_bytes` the measured peak resident set above the resident set before the
switch (Linux VmHWM, reset through /proc/self/clear_refs). On a CPU device "device memory" is
the process's memory, so the bounded mode's host copy is in the resident set too.
CPU only: `--device cuda` is not offered (no GPU to test it on; DCP placement, NCCL groups and
one device per process would all need to change). Every process uses one torch thread, since 4
processes share 2 cores here.

    python bench/reshard.py [--quick] [--repeat N] [--out bench/results/reshard.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from common import machine, write_json
from torch.distributed import AllreduceOptions, PrefixStore, ReduceOp, TCPStore
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from liveshard_agent.engine.backend import Group, new_group, sharded_tensor
from liveshard_agent.engine.state import TORCH_DTYPES, ShardedState
from liveshard_agent.engine.switch import MemoryMode, Reconfiguration
from liveshard_agent.engine.world import StoreAddress, connect_store
from liveshard_core.job import Deadlines
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.layout.region import partition, place
from liveshard_core.plan.plan import Plan, build_plan
from liveshard_core.vps.box import volume
from liveshard_core.vps.spec import ModelSpec, TransformerConfig
from liveshard_e2e.workers import Pool

# DCP warns on every ShardedTensor it plans; this benchmark uses them on purpose (docstring).
warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)

NPROCS = 4
SWITCH_PARTS = ("transfer", "checksum_new", "vote")  # SwitchResult.seconds; transfer includes
# the local copies and the old state's checksum, which overlap the first round
SEED = 7
HOST = "127.0.0.1"
RAW_REPEATS = 3
DEADLINES = Deadlines(op=120.0, switch=600.0, prepare=900.0)
CPU = torch.device("cpu")

# About 1 GiB of training state: 74.7M parameters x 14 bytes (tied embeddings keep it dense
# enough with vocab 32000 at hidden 1024; 4 layers so that pp can go to 3 stages).
FULL = TransformerConfig(
    "dense-1gib", vocab=32000, hidden=1024, layers=4, heads=16, kv_heads=16, head_dim=64,
    ffn=2048, tied_embeddings=True,
)  # fmt: skip
QUICK = TransformerConfig(
    "dense-4mib", vocab=2048, hidden=64, layers=4, heads=4, kv_heads=4, head_dim=16, ffn=128,
    tied_embeddings=True,
)  # fmt: skip
FULL_BUDGET = 256 << 20
QUICK_BUDGET = 256 << 10


@dataclass(frozen=True)
class Transition:
    """A layout change between two degree texts over members m0..m{n-1} (prefixes of them)."""

    name: str
    old: str
    new: str
    old_members: int
    new_members: int

    def layouts(self, spec: ModelSpec) -> tuple[Layout, Layout]:
        old = parse_degrees(self.old).layout(spec, _names(self.old_members))
        new = parse_degrees(self.new).layout(spec, _names(self.new_members))
        return old, new


TRANSITIONS = (
    Transition("dp 2->4 (2 members join)", "dp=2,zero=1", "dp=4,zero=1", 2, 4),
    Transition("tp 2->4", "tp=2,dp=2,zero=1", "tp=4,zero=1", 4, 4),
    Transition("pp 2->3 (member m3 removed)", "pp=2,dp=2,zero=1", "pp=3,zero=1", 4, 3),
)


def _names(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def _worker_of(member: str) -> int:
    """Worker i serves member m{i}."""
    return int(member[1:])


# ---- state dicts of ShardedTensors for DCP ----


def save_state_dict(state: ShardedState) -> dict[str, torch.Tensor]:
    """Every logical tensor, each box saved by its designated (first) holder only."""
    spec, layout, out = state.spec, state.layout, {}
    for ref in spec.tensors():
        param = spec.params[ref.param]
        placed = [
            (box, holders[0])
            for box, holders in partition(layout, place(spec, layout, param, ref.kind))
        ]
        local = dict(state.boxes.get(ref, []))
        dtype = TORCH_DTYPES[spec.dtype(ref.kind)]
        out[spec.tensor_name(ref)] = sharded_tensor(param.shape, dtype, placed, local, state.rank)
    return out


def load_state_dict(state: ShardedState) -> dict[str, torch.Tensor]:
    """Every logical tensor, with every box `state`'s rank holds (replicas included) as a local
    shard: this rank's own metadata places a replicated box on itself when it holds it."""
    spec, layout, rank, out = state.spec, state.layout, state.rank, {}
    for ref in spec.tensors():
        param = spec.params[ref.param]
        parts = partition(layout, place(spec, layout, param, ref.kind))
        placed = [(box, rank if rank in holders else holders[0]) for box, holders in parts]
        local = dict(state.boxes.get(ref, []))
        mine = {box for box, owner in placed if owner == rank}
        if mine != set(local):
            raise AssertionError(f"rank {rank}: partition and held boxes of {ref} disagree")
        dtype = TORCH_DTYPES[spec.dtype(ref.kind)]
        out[spec.tensor_name(ref)] = sharded_tensor(param.shape, dtype, placed, local, rank)
    return out


# ---- tasks of the worker pool (old processes, kept for the whole run) ----

CONTEXT: dict[str, Any] = {}


def _barrier(group: Group) -> None:
    options = AllreduceOptions()
    options.reduceOp = ReduceOp.SUM
    group.allreduce([torch.zeros(1)], options).wait()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def setup(index: int, size: int, port: int) -> int:
    """Connect to the driver's store and build a gloo group over all workers."""
    store = connect_store(StoreAddress(HOST, port), timeout=DEADLINES.op)
    CONTEXT.update(index=index, store=store)
    CONTEXT["group"] = new_group(
        store, prefix="bench/all", rank=index, size=size, device=CPU, timeout=DEADLINES.op
    )
    return os.getpid()


def prepare(
    config: dict[str, Any],
    transition: Transition,
    epoch: int,
    budget: int,
    verify: bool,
    memory: str,
) -> Any:
    """Seed this worker's old state, time the plan's local copies into a scratch state (to split
    the switch's transfer time), and prepare its side of the switch (if it takes part)."""
    spec = ModelSpec.from_config(TransformerConfig(**config))
    old, new = transition.layouts(spec)
    member = f"m{CONTEXT['index']}"
    CONTEXT.update(spec=spec, old=old, new=new, member=member, reconfig=None, state=None)
    if member in old.members:
        CONTEXT["state"] = ShardedState.seeded(spec, old, old.rank_of(member), SEED, CPU)
    _barrier(CONTEXT["group"])
    if member not in old.members and member not in new.members:
        return None
    reconfig = Reconfiguration(
        spec=spec, old=old, new=new, member=member, store=CONTEXT["store"], epoch=epoch,
        device=CPU, budget=budget, deadlines=DEADLINES, verify=verify, memory=MemoryMode(memory),
        job="bench",
    )  # fmt: skip
    start = time.perf_counter()
    reconfig.prepare_in_background().result()
    out = {"prepare": time.perf_counter() - start, **reconfig.seconds, "local_copy": 0.0}
    CONTEXT["reconfig"] = reconfig
    state: ShardedState | None = CONTEXT["state"]
    if state is not None and member in new.members:
        assert reconfig.schedule is not None
        scratch = ShardedState.allocate(spec, new, new.rank_of(member), CPU)
        start = time.perf_counter()
        # What the switch does first.
        for ref, piece in reconfig.schedule.local_copies(reconfig.schedule.part.slot):
            scratch.view(ref, piece.box).copy_(state.view(ref, piece.box))
        out["local_copy"] = time.perf_counter() - start
        del scratch
    return out


def dcp_save(directory: str, epoch: int) -> float | None:
    """The old members save their designated boxes with DCP; returns this rank's save seconds."""
    state: ShardedState | None = CONTEXT["state"]
    if state is None:
        return None
    old: Layout = CONTEXT["old"]
    store = PrefixStore(f"bench/{epoch}/dcp/", CONTEXT["store"])
    dist.init_process_group(
        "gloo", store=store, rank=state.rank, world_size=old.world_size,
        timeout=timedelta(seconds=DEADLINES.switch),
    )  # fmt: skip
    try:
        dist.barrier()
        start = time.perf_counter()
        save(save_state_dict(state), checkpoint_id=directory)
        return time.perf_counter() - start
    finally:
        dist.destroy_process_group()


def switch() -> dict[str, Any]:
    """Every worker meets at a barrier; union members then run the switch, timed."""
    reconfig: Reconfiguration | None = CONTEXT["reconfig"]
    state: ShardedState | None = CONTEXT.pop("state")
    # Collected before the barrier, so that every member starts the switch at the same moment.
    gc.collect()
    rss_before = _rss()
    tracked = _reset_peak_rss()
    _barrier(CONTEXT["group"])
    if reconfig is None:
        return {}
    start = time.perf_counter()
    result = reconfig.switch(state)
    seconds = time.perf_counter() - start
    rss_peak = _peak_rss() if tracked else None
    out = {
        "member": reconfig.member,
        "committed": result.committed,
        "reason": result.reason,
        "switch": seconds,
        "seconds": dict(result.seconds),
        "stats": asdict(result.stats),
        "memory": asdict(result.memory),
        "rss_peak_extra": None if rss_peak is None else rss_peak - rss_before,
        "record": result.record.as_dict(),
        "growth": (result.state.nbytes if result.state is not None else 0) - result.memory.old,
        "wrong_boxes": [],
    }
    if result.state is not None and reconfig.member in reconfig.new.members:
        out["wrong_boxes"] = result.state.matches_seed(SEED)[:5]
    return out


def raw_transport(pairs: list[tuple[int, int, int]], repeats: int, fresh: bool) -> list[float]:
    """Plain gloo send/recv of one buffer per (src worker, dst worker, bytes) pair, all posted
    at once; returns this worker's seconds per repetition. Receive buffers are touched before
    the clock starts, unless `fresh`: then they are newly allocated inside the timed part, as
    the switch's shadow is (first-touch page faults included)."""
    me, group = CONTEXT["index"], CONTEXT["group"]
    sends = [(dst, torch.ones(n, dtype=torch.uint8)) for src, dst, n in pairs if src == me]
    sources = [(src, n) for src, dst, n in pairs if dst == me]
    times = []
    for _ in range(repeats):
        recvs = [] if fresh else [(src, torch.zeros(n, dtype=torch.uint8)) for src, n in sources]
        _barrier(group)
        start = time.perf_counter()
        if fresh:
            recvs = [(src, torch.empty(n, dtype=torch.uint8)) for src, n in sources]
        works = [group.send([buf], dst, 0) for dst, buf in sends]
        works += [group.recv([buf], src, 0) for src, buf in recvs]
        for work in works:
            work.wait()
        times.append(time.perf_counter() - start)
        if any(int(buf[0]) != 1 or int(buf[-1]) != 1 for _, buf in recvs):
            raise AssertionError("raw transport: a receive buffer was not filled")
        del recvs
    return times


def release() -> int:
    """Drop the transition's state, groups and shadow; returns the resident bytes after."""
    for key in ("state", "reconfig", "spec", "old", "new"):
        CONTEXT.pop(key, None)
    gc.collect()
    return _rss()


# ---- the restart side of checkpoint/restart: fresh processes ----


def _restart_main(
    conn: Connection,
    config: dict[str, Any],
    transition: Transition,
    rank: int,
    port: int,
    prefix: str,
    directory: str,
) -> None:
    """A fresh process of the new layout: init the default group, allocate, DCP load, verify."""
    try:
        entered = time.time()
        torch.set_num_threads(1)
        spec = ModelSpec.from_config(TransformerConfig(**config))
        _, new = transition.layouts(spec)
        store = TCPStore(HOST, port, None, False, timedelta(seconds=DEADLINES.op))
        dist.init_process_group(
            "gloo", store=PrefixStore(prefix, store), rank=rank, world_size=new.world_size,
            timeout=timedelta(seconds=DEADLINES.switch),
        )  # fmt: skip
        initialised = time.time()
        state = ShardedState.allocate(spec, new, rank, CPU)
        load(load_state_dict(state), checkpoint_id=directory)
        loaded = time.time()
        wrong = state.matches_seed(SEED)[:5]
        dist.destroy_process_group()
        conn.send(("ok", {"entered": entered, "initialised": initialised, "loaded": loaded,
                          "wrong_boxes": wrong, "state_bytes": state.nbytes}))  # fmt: skip
    except BaseException as err:
        conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def restart_and_load(
    config: dict[str, Any], transition: Transition, store: TCPStore, epoch: int, directory: str
) -> dict[str, Any]:
    """Start the new layout's processes from scratch and load the checkpoint; wall times."""
    ctx = mp.get_context("spawn")
    world = transition.new_members
    prefix = f"bench/{epoch}/restart/"
    procs = []
    spawned = time.time()
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_restart_main,
            args=(child, config, transition, rank, store.port, prefix, directory),
        )
        proc.start()
        child.close()
        procs.append((proc, parent))
    results = []
    for rank, (proc, conn) in enumerate(procs):
        while not conn.poll(0.05):
            if not proc.is_alive():
                raise RuntimeError(f"restarted rank {rank} died (exit code {proc.exitcode})")
        status, value = conn.recv()
        if status == "error":
            raise RuntimeError(f"restarted rank {rank} failed: {value}")
        results.append(value)
        proc.join(60)
    wrong = [w for r in results for w in r["wrong_boxes"]]
    if wrong:
        raise AssertionError(f"{transition.name}: DCP load differs from the seed: {wrong[:5]}")
    initialised = max(r["initialised"] for r in results)
    return {
        "restart": initialised - spawned,
        "load": max(r["loaded"] for r in results) - initialised,
        "restart_until_imported": max(r["entered"] for r in results) - spawned,
    }


# ---- the driver ----


def pair_bytes(plan: Plan) -> dict[tuple[int, int], int]:
    """Network bytes of the plan per (src, dst) pair of union indices."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for g in plan.groups:
        for piece in plan.pattern_of(g).network:
            out[(piece.src, piece.dst)] += volume(piece.box) * g.itemsize * len(g.tensors)
    return dict(out)


def _checkpoint_root() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > 4 << 30:
        return shm
    return tempfile.gettempdir()


def _max(rows: list[dict[str, Any]], key: str) -> float:
    return max(float(r[key]) for r in rows)


def run_once(
    pool: Pool,
    store: TCPStore,
    config: TransformerConfig,
    transition: Transition,
    plan: Plan,
    epoch: int,
    budget: int,
    *,
    verify: bool = True,
    memory: str = "resident",
    with_checkpoint: bool = False,
) -> dict[str, Any]:
    """One repetition from the seeded old state: with `with_checkpoint`, DCP save, restart and
    load, then the switch (`verify`: checksums of the moved bytes or none; `memory`: a
    `MemoryMode` value)."""
    config_dict = asdict(config)
    prepared = [p for p in pool.all("prepare", config=config_dict, transition=transition,
                                    epoch=epoch, budget=budget, verify=verify,
                                    memory=memory) if p]  # fmt: skip
    checkpoint: dict[str, Any] = {}
    if with_checkpoint:
        # Checkpoint/restart first, from the same seeded old state the switch then starts from.
        checkpoint = checkpoint_restart(pool, store, config_dict, transition, epoch)

    switched = [s for s in pool.all("switch") if s]
    pool.all("release")
    failed = [s for s in switched if not s["committed"] or s["wrong_boxes"]]
    if failed:
        raise AssertionError(f"{transition.name}: switch failed: {failed}")
    sent = sum(s["stats"]["sent_bytes"] for s in switched)
    if sent != plan.network_bytes:
        raise AssertionError(
            f"{transition.name}: sent {sent} bytes, plan says {plan.network_bytes}"
        )
    parts = {k: max(s["seconds"][k] for s in switched) for k in SWITCH_PARTS}
    rss = [s["rss_peak_extra"] for s in switched if s["rss_peak_extra"] is not None]
    return {
        "plan": _max(prepared, "plan"),
        "prepare": _max(prepared, "prepare"),
        "local_copy": _max(prepared, "local_copy"),
        "switch": _max(switched, "switch"),
        "parts": parts,
        "rounds": max(s["stats"]["rounds"] for s in switched),
        "peak_extra": max(s["memory"]["peak_extra"] for s in switched),
        # Whether every member's peak extra memory stayed within the budget plus its growth.
        "within_bound": all(
            s["memory"]["peak_extra"] <= budget + max(s["growth"], 0) for s in switched
        ),
        "memory_mode": {s["record"]["memory_mode"] for s in switched}.pop(),
        "peak_staging": max(s["memory"]["peak_staging"] for s in switched),
        "rss_peak_extra": max(rss) if rss else None,
        **checkpoint,
    }


def checkpoint_restart(
    pool: Pool, store: TCPStore, config: dict[str, Any], transition: Transition, epoch: int
) -> dict[str, Any]:
    """DCP save from the old processes, then fresh processes that load the new layout."""
    root = _checkpoint_root()
    directory = tempfile.mkdtemp(prefix="liveshard-reshard-", dir=root)
    try:
        saves = pool.all("dcp_save", directory=directory, epoch=epoch)
        save_seconds = max(s for s in saves if s is not None)
        size = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs
        )
        restart = restart_and_load(config, transition, store, epoch, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "checkpoint": {"save": save_seconds, **restart},
        "checkpoint_total": save_seconds + restart["restart"] + restart["load"],
        "checkpoint_bytes": size,
        "checkpoint_dir": root,
    }


def measure(
    pool: Pool,
    store: TCPStore,
    config: TransformerConfig,
    transition: Transition,
    epochs: itertools.count[int],
    budget: int,
    repeat: int,
) -> dict[str, Any]:
    """Best of `repeat` repetitions of switch and of checkpoint/restart, and the raw transport."""
    spec = ModelSpec.from_config(config)
    old, new = transition.layouts(spec)
    plan = build_plan(spec, old, new)
    runs = [run_once(pool, store, config, transition, plan, next(epochs), budget,
                     with_checkpoint=True) for _ in range(repeat)]  # fmt: skip

    def fastest(**options: Any) -> dict[str, Any]:
        return min(
            (run_once(pool, store, config, transition, plan, next(epochs), budget, **options)
             for _ in range(repeat)),
            key=lambda r: r["switch"],
        )  # fmt: skip

    unverified, bounded = fastest(verify=False), fastest(memory="bounded")
    best = min(runs, key=lambda r: r["switch"])
    ckpt = min(runs, key=lambda r: r["checkpoint_total"])
    pairs = [
        (_worker_of(plan.members[s]), _worker_of(plan.members[d]), n)
        for (s, d), n in sorted(pair_bytes(plan).items())
    ]
    raw, raw_fresh = (
        min(max(per_rank) for per_rank in zip(*pool.all("raw_transport", pairs=pairs,
            repeats=RAW_REPEATS, fresh=fresh), strict=True))
        for fresh in (False, True)
    )  # fmt: skip
    transfer = best["parts"]["transfer"]
    switch_seconds = best["switch"]
    network = plan.network_bytes
    return {
        "transition": transition.name,
        "from": transition.old,
        "to": transition.new,
        "nprocs": NPROCS,
        "ranks_from": old.world_size,
        "ranks_to": new.world_size,
        "model": config.name,
        "state_bytes": spec.state_bytes,
        "network_bytes": network,
        "local_bytes": plan.local_bytes,
        "pairs": len(pairs),
        "rounds": best["rounds"],
        "repeat": repeat,
        "plan_seconds": round(min(r["plan"] for r in runs), 4),
        "prepare_seconds": round(min(r["prepare"] for r in runs), 4),
        "switch_seconds": round(switch_seconds, 4),
        "switch_parts_seconds": {k: round(v, 4) for k, v in best["parts"].items()},
        "transfer_seconds": round(transfer, 4),
        "local_copy_seconds": round(best["local_copy"], 4),
        "raw_transport_seconds": round(raw, 4),
        "raw_transport_fresh_buffers_seconds": round(raw_fresh, 4),
        "bandwidth_bytes_per_second": round(network / transfer),
        "raw_bandwidth_bytes_per_second": round(network / raw),
        "fraction_of_raw": round(raw / transfer, 3),
        "fraction_of_raw_fresh_buffers": round(raw_fresh / transfer, 3),
        "checkpoint_restart_seconds": round(ckpt["checkpoint_total"], 4),
        "checkpoint_restart_parts_seconds": {k: round(v, 4) for k, v in ckpt["checkpoint"].items()},
        "checkpoint_bytes": ckpt["checkpoint_bytes"],
        "checkpoint_dir": ckpt["checkpoint_dir"],
        "speedup": round(ckpt["checkpoint_total"] / switch_seconds, 2),
        # The pause beyond the raw transport of the same bytes, per schedule round.
        "round_overhead_seconds": round((switch_seconds - raw) / max(best["rounds"], 1), 5),
        "targets_met": {
            "fraction_of_raw>=0.8": raw / transfer >= 0.8,
            "speedup>=20": ckpt["checkpoint_total"] / switch_seconds >= 20,
        },
        # The same switch with verify=False: no checksums, the vote carries failures only.
        "unverified_switch_seconds": round(unverified["switch"], 4),
        "unverified_transfer_seconds": round(unverified["parts"]["transfer"], 4),
        "unverified_fraction_of_raw": round(raw / unverified["parts"]["transfer"], 3),
        "unverified_speedup": round(ckpt["checkpoint_total"] / unverified["switch"], 2),
        "peak_extra_bytes": best["peak_extra"],
        "memory_mode": best["memory_mode"],
        # The bounded memory mode (old state to host memory, shadow filled as old storage is
        # given back), verified, in the same run.
        "bounded_switch_seconds": round(bounded["switch"], 4),
        "bounded_transfer_seconds": round(bounded["parts"]["transfer"], 4),
        "bounded_speedup": round(ckpt["checkpoint_total"] / bounded["switch"], 2),
        "bounded_peak_extra_bytes": bounded["peak_extra"],
        "bounded_within_budget_plus_growth": bounded["within_bound"],
        "peak_staging_bytes": best["peak_staging"],
        "rss_peak_extra_bytes": best["rss_peak_extra"],
        "budget_bytes": budget,
        "device": "cpu",
        "machine": machine(f"torch {torch.__version__}"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a model of a few MiB, for smoke runs")
    parser.add_argument("--out", help="also write all results to this JSON file")
    parser.add_argument(
        "--repeat", type=int, help="repetitions of switch and checkpoint/restart (best kept)"
    )
    args = parser.parse_args()
    if importlib.util.find_spec("numpy") is None:
        raise SystemExit(
            "bench/reshard.py needs numpy for its checkpoint comparator: torch.distributed"
            ".checkpoint's object collectives call Tensor.numpy(); pip install numpy"
        )
    config = QUICK if args.quick else FULL
    budget = QUICK_BUDGET if args.quick else FULL_BUDGET
    repeat = args.repeat or (1 if args.quick else 2)

    store = TCPStore(HOST, 0, None, True, timedelta(seconds=DEADLINES.op), wait_for_workers=False)
    pool = Pool(NPROCS, __name__, threads=1, timeout=1800)
    results = []
    try:
        pool.run(
            {w: ("setup", {"index": w, "size": NPROCS, "port": store.port}) for w in range(NPROCS)}
        )
        epochs = itertools.count(1)
        for transition in TRANSITIONS:
            result = measure(pool, store, config, transition, epochs, budget, repeat)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        pool.close()
    write_json(args.out, results)


if __name__ == "__main__":
    main()
