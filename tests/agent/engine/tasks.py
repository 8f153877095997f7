"""Tasks the engine tests run inside worker processes (`liveshard_e2e.workers.Pool`), gloo, CPU.

A worker keeps `CONTEXT` between tasks, so a test can run several switches in one process
lifetime. Faults are installed from here, through the switch's hooks, as a test asks for them
(`inject`), or by wrapping the union group a reconfiguration prepared (`CorruptingGroup`): the
product itself has no fault injection.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
from torch.distributed import AllreduceOptions

from liveshard_agent.engine.checksum import Checksums
from liveshard_agent.engine.errors import PlanMismatch
from liveshard_agent.engine.state import ShardedState
from liveshard_agent.engine.switch import (
    Deadlines,
    MemoryMode,
    Reconfiguration,
    SwitchHooks,
    Verification,
)
from liveshard_agent.engine.world import (
    Axis,
    StoreAddress,
    World,
    connect_store,
    host_store,
    wait_closed,
)
from liveshard_core.layout.layout import parse_degrees
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, TransformerConfig

CONTEXT: dict[str, Any] = {}
CPU = torch.device("cpu")


class InjectedFault(RuntimeError):
    """A failure a test asked for."""


def inject(fault: tuple[str, int, float] | None) -> SwitchHooks:
    """Hooks that inject `fault` = (kind, round, seconds) at this member: `vote_no` (it votes
    no), `exit` (the process dies without warning as round `round` starts) or `stall` (it stops
    answering for `seconds` as round `round` starts)."""
    if fault is None:
        return SwitchHooks()
    kind, at_round, seconds = fault
    if kind == "vote_no":

        def vote_no() -> None:
            raise InjectedFault("injected vote no")

        return SwitchHooks(before_vote=vote_no)

    def before_round(r: int) -> None:
        if r != at_round:
            return
        if kind == "exit":
            os._exit(17)
        time.sleep(seconds)

    return SwitchHooks(before_round=before_round)


class CorruptingGroup:
    """A union group that changes one bit of the first message this member receives, once it
    has arrived: a transport that delivers a wrong byte."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.corrupted: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return _CorruptOnWait(self, self.group.recv(tensors, src, tag), tensors[0])


class _CorruptOnWait:
    def __init__(self, owner: CorruptingGroup, work: Any, buffer: torch.Tensor) -> None:
        self.owner, self.work, self.buffer = owner, work, buffer

    def wait(self, *args: Any) -> Any:
        done = self.work.wait(*args)
        if self.owner.corrupted is None and self.buffer.numel() > 0:
            bits = self.buffer.reshape(-1).view(torch.uint8)
            bits[0] = int(bits[0]) ^ 1
            self.owner.corrupted = f"{self.buffer.dtype} of {self.buffer.numel()} elements"
        return done


def host() -> int:
    """Host the job's store in this worker (a surviving member hosts it); returns its port."""
    CONTEXT["store"] = host_store(StoreAddress("127.0.0.1", 0), timeout=30)
    return int(CONTEXT["store"].port)


def usage() -> dict[str, int]:
    """Native threads and resident bytes of this worker, once the groups of past switches have
    closed (they close in the background)."""
    assert wait_closed(30), "groups still closing after 30 s"
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": len(os.listdir("/proc/self/task")), "rss": rss,
            "python_threads": threading.active_count()}  # fmt: skip


def _spec(model: Any) -> ModelSpec:
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
    deadlines: tuple[float, float, float] = (10, 20, 30),
    keep: bool = False,
    train: bool = False,
    lost: tuple[str, ...] = (),
    verify: bool | str = Verification.STATE.value,
    memory: str = MemoryMode.RESIDENT.value,
    corrupt: bool = False,
    pods: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One member's side of a switch from `old` to `new` (degrees text, members), starting from
    the seeded state (or the state kept from the previous task with `keep`). The tests verify the
    whole state unless they ask otherwise (`verify`: a `Verification` value, or a bool).
    `corrupt` changes one bit of the first message this member receives."""
    spec = _spec(model)
    old_layout = parse_degrees(old[0]).layout(spec, old[1])
    new_layout = parse_degrees(new[0]).layout(spec, new[1])
    store = CONTEXT.get("store") or connect_store(StoreAddress("127.0.0.1", port), timeout=30)
    state = None
    if member in old_layout.ranks:
        state = CONTEXT.get("state") if keep else None
        if state is None:
            state = ShardedState.seeded(spec, old_layout, old_layout.rank_of(member), seed, CPU)
    before = Checksums.of_state(state).sums.tolist() if state is not None else None
    before_bytes = state.nbytes if state is not None else 0
    reconfig = Reconfiguration(
        spec=spec, old=old_layout, new=new_layout, member=member, store=store, epoch=epoch,
        device=CPU, budget=budget, deadlines=Deadlines(*deadlines), lost=frozenset(lost),
        pods=pods, verify=Verification(verify) if isinstance(verify, str) else verify,
        memory=MemoryMode(memory), job="test", hooks=inject(fault),
    )  # fmt: skip
    old_world = None
    if train and member in old_layout.ranks:
        old_world = World.build(
            store, epoch=epoch + 10_000, tag="test", layout=old_layout, member=member, device=CPU,
            timeout=20,
        )  # fmt: skip
    steps = 0
    try:
        preparing = reconfig.prepare_in_background()
        if old_world is not None:
            steps = _train_until(preparing, old_world)
        preparing.result()
    except PlanMismatch as err:
        intact = state is not None and not state.matches_seed(seed)
        return {"committed": False, "reason": str(err), "cause": err.cause.value,
                "mismatch": True, "intact": intact}  # fmt: skip
    corrupting = None
    if corrupt:
        corrupting = CorruptingGroup(reconfig.union)
        reconfig.union = corrupting  # type: ignore[assignment]
    start = time.monotonic()  # the switch alone: what its deadline bounds
    result = reconfig.switch(state)
    elapsed = time.monotonic() - start
    after = result.state
    CONTEXT["state"] = after
    return {
        "committed": result.committed,
        "cause": result.cause.value if result.cause else None,
        "reason": result.reason,
        "record": result.record.as_dict(),
        "seconds": elapsed,
        "wrong_boxes": after.matches_seed(seed) if after is not None else [],
        "state_bytes": after.nbytes if after is not None else 0,
        "old_released": state is not None and state.released,
        "old_intact": before is None
        or (not result.committed and Checksums.of_state(after).sums.tolist() == before),
        "peak_staging": result.memory.peak_staging,
        "budget": result.memory.budget,
        "rounds": result.stats.rounds,
        "sent": result.stats.sent_bytes,
        "received": result.stats.received_bytes,
        "steps_while_preparing": steps,
        "corrupted": corrupting.corrupted if corrupting is not None else None,
        "old_bytes": before_bytes,
        "phases": {k: round(v, 3) for k, v in result.seconds.items()},
    }


def _train_until(done: Any, world: World) -> int:
    """Stand-in for training in the old world: all-reduces on its world group until `done`;
    returns the number of steps, each checked for the right sum."""
    size = world.layout.world_size
    steps = 0
    while True:
        # Members agree through the old world whether every one of them is done preparing.
        flag = torch.tensor([0 if done.done() else 1, 1])
        world.group(Axis.WORLD).allreduce([flag], AllreduceOptions()).wait()
        if flag[0] < size:
            return steps
        assert int(flag[1]) == size
        steps += 1
