"""Training benchmark: step time per layout, the switch machinery's overhead, and live switches
against checkpoint + restart + load of the same job.

On this machine (CPU, gloo, 4 member processes, one torch thread each), in one run:

1. The launcher sequence `--switch 20:tp=2,dp=2 --switch 40:pp=2,dp=2` on `tiny` (60 steps), with
   a checkpoint saved at steps 20 and 40 of the same run, just before each switch. Per switch:
   the exposed pause (the end of the last step before it to the start of the first step after
   it, maximum over members), the prepare time (overlapped with training), the bytes moved; and
   what the same change costs the way users do it today: the checkpoint's save time (measured in
   this run) plus a restart: fresh processes for the new layout (start, `import torch`, the new
   world's groups) that load the checkpoint (`liveshard-local --resume`), timed from the spawn
   to the start of their first step. Target: the pause at least 20x shorter.
2. Step time and tokens per second per layout (median over the steps of each layout, after the
   first one, from the same run).
3. The switch machinery's overhead: on a pool of 4 processes, the median step time of the bare
   training loop (`Trainer.step`) against the member loop with a prepared next world kept all
   along (a pending change, the union and new world's groups and the shadow state built, its
   readiness carried in every step's all-reduce; `Member.train_step` + `at_boundary`), blocks of
   steps alternating between the two. Target: under 1%. And the step time while a prepare runs
   in the background (the steps that start before it finishes) against without.
4. Recovery from a member that dies without notice (`--kill 20:1`: it kills its own process as it
   begins step 20, just after a checkpoint at step 20): the recovery's pause (the survivors' break
   to their first step after, maximum over members) with a new process in the dead member's place,
   and with a pre-warmed standing-by process there (a switch to dp=3 at step 5 leaves one), against
   a restart of fresh processes from that checkpoint (which loses no step here; in general it
   also loses the steps since the last checkpoint).

    python bench/training.py [--quick] [--out bench/results/training.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
from common import machine, write_json
from torch.distributed import TCPStore

from liveshard_agent.local.launcher import (
    Driver,
    LocalJob,
    ScriptedKill,
    local_config,
    parse_switch,
    run_job,
)
from liveshard_agent.runtime.change import Change
from liveshard_agent.runtime.member import Member
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from liveshard_e2e.workers import Pool

HOST = "127.0.0.1"
NPROCS = 4
SEQUENCE = ("20:tp=2,dp=2", "40:pp=2,dp=2")


def _job(layout: str, steps: int, **options: Any) -> LocalJob:
    degrees = parse_degrees(layout)
    options.setdefault("switches", ())
    return LocalJob(
        config=local_config("tiny", TrainingSettings(steps=steps)), nprocs=degrees.world_size,
        layout=degrees, **options,
    )  # fmt: skip


class _FirstStep(Exception):
    """Ends a restarted job once its first step is done."""


# ---- 1 and 2: the launcher sequence, against checkpoint + restart + load ----


def restart_seconds(layout: str, checkpoint: str, steps: int) -> dict[str, float]:
    """Fresh processes of `layout` that resume the same job from `checkpoint`: seconds from the
    spawn to the start of their first step (the end of that step minus its own time)."""
    start = time.perf_counter()
    first: dict[str, float] = {}

    def emit(event: dict[str, Any]) -> None:
        if event["event"] == "step":
            first["at"] = time.perf_counter() - start - event["step_seconds"]
            first["step_seconds"] = event["step_seconds"]
            raise _FirstStep

    with contextlib.suppress(_FirstStep):
        Driver(_job(layout, steps, resume=checkpoint), emit).run()
    return {"restart_and_load": first["at"], "first_step": first["step_seconds"]}


def sequence(steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="liveshard-training-", dir=_scratch()) as scratch:
        switches = tuple(parse_switch(s) for s in SEQUENCE)
        job = _job("dp=4", steps, switches=switches, checkpoint_dir=scratch, checkpoint_every=20)
        events = run_job(job)
        saves = {e["step"]: e for e in events if e["event"] == "checkpoint"}
        out = []
        for switch in (e for e in events if e["event"] == "switch"):
            if switch["result"] != "committed":
                raise AssertionError(f"switch failed: {switch}")
            step = switch["step"]
            if step not in saves:
                raise AssertionError(f"switched at step {step}, not at a checkpointed step")
            layout = switch["to"]
            restart = restart_seconds(layout, saves[step]["path"], steps)
            total = saves[step]["seconds"] + restart["restart_and_load"]
            out.append({
                "step": step, "from": switch["from"], "to": layout,
                "pause_seconds": switch["pause_seconds"],
                "prepare_seconds": switch["prepare_seconds"],
                "network_bytes": switch["network_bytes"],
                "checkpoint_save_seconds": saves[step]["seconds"],
                "restart_and_load_seconds": round(restart["restart_and_load"], 4),
                "checkpoint_restart_seconds": round(total, 4),
                "speedup": round(total / switch["pause_seconds"], 1),
                "target_speedup>=20": total / switch["pause_seconds"] >= 20,
            })  # fmt: skip
    layouts: dict[str, list[float]] = {}
    for e in events:
        if e["event"] == "step":
            layouts.setdefault(e["layout"], []).append(e["step_seconds"])
    per_layout = [
        {
            "layout": layout,
            "steps": len(times),
            "step_seconds": round(statistics.median(times[1:]), 4),
            "tokens_per_second": round(job.settings.tokens_per_step / statistics.median(times[1:])),
        }
        for layout, times in layouts.items()
    ]
    final = [e for e in events if e["event"] == "step"][-1]
    return {"switches": out, "layouts": per_layout, "final_loss": round(final["loss"], 4)}


# ---- 4: recovery from a member that dies ----


def recovery(steps: int) -> dict[str, Any]:
    kill = ScriptedKill(20, 1)
    out: dict[str, Any] = {}
    scenarios = [("new process", "dp=4", ()), ("standing-by process", "dp=4", ("5:dp=3",))]
    with tempfile.TemporaryDirectory(prefix="liveshard-recovery-", dir=_scratch()) as scratch:
        for label, layout, switches in scenarios:
            directory = os.path.join(scratch, label.replace(" ", "-"))
            events = run_job(_job(
                layout, steps, switches=tuple(parse_switch(s) for s in switches), kills=(kill,),
                checkpoint_dir=directory, checkpoint_every=kill.step,
            ))  # fmt: skip
            (done,) = [e for e in events if e["event"] == "switch" and e["lost"]]
            if done["result"] != "committed":
                raise AssertionError(f"recovery failed: {done}")
            (save,) = [e for e in events if e["event"] == "checkpoint" and e["step"] == kill.step]
            restart = restart_seconds(done["to"], save["path"], steps)["restart_and_load"]
            out[label] = {
                "layout": done["to"], "lost": done["lost"], "step": done["step"],
                "pause_seconds": done["pause_seconds"],
                "prepare_seconds": done["prepare_seconds"],
                "switch_seconds": done["switch_seconds"].get("pause"),
                "network_bytes": done["network_bytes"],
                "checkpoint_restart_seconds": round(restart, 4),
                "speedup": round(restart / done["pause_seconds"], 1),
            }  # fmt: skip
    return out


def _scratch() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# ---- 3: the machinery's overhead (tasks run in the pool's processes) ----

CONTEXT: dict[str, Any] = {}


def setup(index: int, port: int, layout: str, steps: int) -> None:
    store = TCPStore(HOST, port, None, False, timedelta(seconds=60))
    member = Member(
        name=f"m{index}", spec=_job(layout, steps).spec(), settings=TrainingSettings(steps=steps),
        store=store, device=torch.device("cpu"),
    )  # fmt: skip
    member.start(parse_degrees(layout).layout(member.spec, [f"m{i}" for i in range(NPROCS)]))
    CONTEXT["member"] = member


def request(epoch: int, layout: str, at_step: int) -> None:
    member: Member = CONTEXT["member"]
    assert member.layout is not None
    new = parse_degrees(layout).layout(member.spec, list(member.layout.members))
    member.request(Change(epoch=epoch, old=member.layout, new=new, at_step=at_step))


def bare_steps(count: int) -> list[float]:
    """The training loop without the switch machinery."""
    member: Member = CONTEXT["member"]
    assert member.trainer is not None
    times = []
    for _ in range(count):
        start = time.perf_counter()
        member.trainer.step()
        times.append(time.perf_counter() - start)
    return times


def member_steps(count: int) -> list[tuple[float, bool]]:
    """The member loop: each step carries readiness, then the boundary check; with whether a
    prepare was still running when the step started."""
    member: Member = CONTEXT["member"]
    out = []
    for _ in range(count):
        preparing = member.pending is not None and not member.pending.future.done()
        start = time.perf_counter()
        member.train_step()
        events = member.at_boundary()
        out.append((time.perf_counter() - start, preparing))
        if events:
            raise AssertionError(f"the benchmark's change switched: {events}")
    return out


def overhead(blocks: int, per_block: int) -> dict[str, Any]:
    store = TCPStore(HOST, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    pool = Pool(NPROCS, sys.modules[__name__], threads=1, timeout=1800)
    try:
        layout, steps = "dp=4", 1_000_000
        pool.run({w: ("setup", dict(index=w, port=store.port, layout=layout, steps=steps))
                  for w in range(NPROCS)})  # fmt: skip
        pool.all("bare_steps", count=5)  # warm up
        without = max(pool.all("bare_steps", count=per_block), key=sum)
        # A change far in the future: prepared, kept, never switched.
        pool.all("request", epoch=1, layout="tp=2,dp=2", at_step=steps)
        with_prepare = max(
            pool.all("member_steps", count=per_block), key=lambda t: sum(s for s, _ in t)
        )
        bare: list[float] = []
        machinery: list[float] = []
        for _ in range(blocks):
            bare += max(pool.all("bare_steps", count=per_block), key=sum)
            times = max(
                pool.all("member_steps", count=per_block), key=lambda t: sum(s for s, _ in t)
            )
            machinery += [s for s, _ in times]
    finally:
        pool.close()
    during = [s for s, preparing in with_prepare if preparing]
    bare_median, machinery_median = statistics.median(bare), statistics.median(machinery)
    return {
        "layout": layout,
        "bare_step_seconds": round(bare_median, 5),
        "member_step_seconds": round(machinery_median, 5),
        "overhead": round(machinery_median / bare_median - 1, 4),
        "target_overhead<0.01": machinery_median / bare_median - 1 < 0.01,
        "steps_per_side": len(bare),
        "steps_while_preparing": len(during),
        "step_seconds_while_preparing": round(statistics.median(during), 5) if during else None,
        "step_seconds_without_prepare": round(statistics.median(without), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, for smoke runs")
    parser.add_argument("--out", help="also write the results to this JSON file")
    args = parser.parse_args()
    result = {
        "machine": machine(f"torch {torch.__version__}"),
        "model": "tiny (fp32 parameters, no master)",
        "nprocs": NPROCS,
        "sequence": sequence(60),
        "overhead": overhead(blocks=2 if args.quick else 6, per_block=10 if args.quick else 20),
        "recovery": recovery(30),
    }
    print(json.dumps(result, indent=1), flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
