"""A pool of worker processes for multi-process tests of the transfer engine (gloo, CPU).

Each worker is a spawned process that imports torch once and then runs tasks sent by the test:
module-level functions of this file, called with keyword arguments. A worker keeps a `CONTEXT`
dict between tasks, so a test can run several switches in one process lifetime.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

CONTEXT: dict[str, Any] = {}


def _serve(conn: Connection) -> None:
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", globals()[name](**kwargs)))
        except BaseException as err:  # report every failure to the test, then keep serving
            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


@dataclass
class Died:
    """A worker that exited while running a task."""

    exitcode: int | None


class Pool:
    def __init__(self, size: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.workers: list[tuple[Any, Connection]] = [self._start() for _ in range(size)]

    def _start(self) -> tuple[Any, Connection]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child,), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def run(
        self, tasks: dict[int, tuple[str, dict[str, Any]]], timeout: float = 120
    ) -> dict[int, Any]:
        """Run one task on each named worker at once; a worker that dies is restarted and its
        result is `Died`. Task errors raise AssertionError with the worker's traceback."""
        for w, task in tasks.items():
            self.workers[w][1].send(task)
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        for w in tasks:
            proc, conn = self.workers[w]
            while not conn.poll(0.05):
                if not proc.is_alive():
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker {w} did not answer within {timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:  # the worker died: its end of the pipe closed
                proc.join(5)
                results[w] = Died(proc.exitcode)
                self.workers[w] = self._start()
                continue
            if status == "error":
                errors.append(f"worker {w} failed: {value}")
            results[w] = value
        # Every worker has answered before this raises, so the next task starts in step.
        if errors:
            raise AssertionError("\n".join(errors))
        return results

    def close(self) -> None:
        for proc, conn in self.workers:
            conn.close()
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# ---- tasks (run inside the workers) ----


def host_store() -> int:
    """Host the job's store in this worker (a surviving member hosts it); returns its port."""
    from liveshard_agent.world import StoreAddress, host_store

    CONTEXT["store"] = host_store(StoreAddress("127.0.0.1", 0), timeout=30)
    return int(CONTEXT["store"].port)


def usage() -> dict[str, int]:
    """Native threads and resident bytes of this worker."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": len(os.listdir("/proc/self/task")), "rss": rss,
            "python_threads": threading.active_count()}  # fmt: skip


def _spec(model: Any) -> Any:
    from liveshard_agent.vps.presets import preset
    from liveshard_agent.vps.spec import ModelSpec, TransformerConfig

    return (
        preset(model)
        if isinstance(model, str)
        else ModelSpec.from_config(TransformerConfig(**model))
    )


def switch(
    member: str,
    port: int,
    epoch: int,
    model: Any,
    old: tuple[str, list[str]],
    new: tuple[str, list[str]],
    seed: int = 1,
    budget: int = 1 << 20,
    fault: tuple[str, int, float] | None = None,
    timeouts: tuple[float, float, float] = (10, 20, 30),
    keep: bool = False,
    train: bool = False,
    lost: list[str] = (),  # type: ignore[assignment]
    verify: bool = True,
) -> dict[str, Any]:
    """One member's side of a switch from `old` to `new` (degrees text, members), starting from
    the seeded state (or the state kept from the previous task with `keep`)."""
    import torch

    from liveshard_agent.layout.layout import parse_degrees
    from liveshard_agent.state import ShardedState
    from liveshard_agent.switch import Fault, FaultKind, PlanMismatch, Reconfiguration, Timeouts
    from liveshard_agent.world import StoreAddress, World, connect_store

    spec = _spec(model)
    cpu = torch.device("cpu")
    old_layout = parse_degrees(old[0]).layout(spec, old[1])
    new_layout = parse_degrees(new[0]).layout(spec, new[1])
    store = CONTEXT.get("store") or connect_store(StoreAddress("127.0.0.1", port), timeout=30)
    state = None
    if member in old_layout.members:
        state = CONTEXT.get("state") if keep else None
        if state is None:
            rank = old_layout.members.index(member)
            state = ShardedState.seeded(spec, old_layout, rank, seed, cpu)
    before = state.checksums().tolist() if state is not None else None
    reconfig = Reconfiguration(
        spec, old_layout, new_layout, member, store, epoch, cpu, budget, Timeouts(*timeouts),
        frozenset(lost), verify,
    )  # fmt: skip
    old_world = None
    if train and member in old_layout.members:
        old_world = World.build(store, epoch + 10_000, old_layout, member, cpu, timeout=20)
    steps = 0
    try:
        preparing = reconfig.prepare_in_background()
        if old_world is not None:
            steps = _train_until(preparing, old_world)
        preparing.result()
    except PlanMismatch as err:
        intact = state is not None and not state.matches_seed(seed)
        return {"committed": False, "reason": str(err), "mismatch": True, "intact": intact}
    injected = Fault(FaultKind(fault[0]), fault[1], fault[2]) if fault else None
    start = time.monotonic()  # the switch alone: what its deadline bounds
    result = reconfig.switch(state, injected)
    elapsed = time.monotonic() - start
    after = result.state
    CONTEXT["state"] = after
    return {
        "committed": result.committed,
        "reason": result.reason,
        "seconds": elapsed,
        "wrong_boxes": after.matches_seed(seed) if after is not None else [],
        "state_bytes": after.nbytes if after is not None else 0,
        "old_intact": before is None
        or (not result.committed and after.checksums().tolist() == before),
        "peak_staging": result.memory.peak_staging,
        "budget": result.memory.budget,
        "rounds": result.stats.rounds,
        "sent": result.stats.sent_bytes,
        "steps_while_preparing": steps,
        "phases": {k: round(v, 3) for k, v in result.seconds.items()},
        "received": result.stats.received_bytes,
    }


def _train_until(done: Any, world: Any) -> int:
    """Stand-in for training in the old world: all-reduces on its world group until `done`;
    returns the number of steps, each checked for the right sum."""
    import torch
    from torch._C._distributed_c10d import AllreduceOptions

    size = world.layout.world_size
    steps = 0
    while True:
        # Members agree through the old world whether every one of them is done preparing.
        flag = torch.tensor([0 if done.done() else 1, 1])
        world.groups["world"].allreduce([flag], AllreduceOptions()).wait()
        if flag[0] < size:
            return steps
        assert int(flag[1]) == size
        steps += 1
