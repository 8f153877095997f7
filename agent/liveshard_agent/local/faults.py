"""`liveshard-local --kill STEP:RANK[:PHASE]`, `--hang` and `--stall`: a member that dies, stops or
falls behind without notice, at a known point.

The member at RANK of the layout in effect kills its own process (SIGKILL; `--hang`: stops it,
SIGSTOP; `--stall`: its training sleeps one and a half op deadlines, past its peers' collective
timeouts but within the silence the launcher allows) at PHASE:
- `step` (the default): as it begins step STEP;
- `update`: in step STEP, once its update is applied and its step reported, before ZeRO-1
  shares the updated rows (the others' sharing then fails: their shards hold the step, their
  other rows do not);
- `prepare`, `transfer`, `vote`, `commit`: inside the switch scripted at step STEP (`--switch
  STEP:...`): as its prepare starts, as the transfer's first round starts, as it is about to cast
  its vote, or once the vote's all-reduce is done and before the decision is recorded (the
  others commit without it).
Each kill happens once per job: the recovery resumes at the same point, maybe with another member
at RANK. The survivors' world breaks and the launcher answers with a recovery, as the operator does
on Kubernetes; a stopped member is found silent (its peers' world broke, it said nothing) and
killed; after a stall, every member's world has broken and none is lost: the launcher rebuilds the
world in the same layout from the step they stopped at. This module is the whole of that harness:
the flags' values (`ScriptedKill`) and the member's part (`Faults`). The runtime and the engine
know nothing of it; tests inject their own faults through `LocalJob.hooks` instead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from torch.distributed import Store

from liveshard_core.errors import InvalidInput

from ..engine import keys
from ..engine.switch import SwitchHooks
from ..runtime.change import Change
from ..runtime.member import Member

SWITCH_PHASES = ("prepare", "transfer", "vote", "commit")  # inside a switch scripted at STEP
PHASES = ("step", "update", *SWITCH_PHASES)


class Fault(StrEnum):
    """What the member does at the scripted point: the flag that asked for it."""

    KILL = "kill"
    HANG = "hang"
    STALL = "stall"


@dataclass(frozen=True)
class ScriptedKill:
    """The member at `rank` of the layout in effect kills its own process (`action` KILL),
    stops it (HANG) or sleeps (STALL) at `phase` of step `step`: a failure without notice,
    at a known point."""

    step: int
    rank: int
    phase: str = "step"
    action: Fault = Fault.KILL


def parse_kill(text: str, action: Fault = Fault.KILL) -> ScriptedKill:
    """`STEP:RANK[:PHASE]`, e.g. `15:1` or `20:0:vote`, for `--kill`, `--hang` or `--stall`
    (`action`)."""
    parts = text.split(":")
    if len(parts) == 2:
        parts.append("step")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts[:2]) or parts[2] not in PHASES:
        raise InvalidInput(
            f"--{action} {text!r}: expected STEP:RANK[:PHASE] with PHASE "
            f"one of {', '.join(PHASES)}, e.g. 15:1 or 20:0:vote"
        )
    step, rank, phase = parts
    return ScriptedKill(int(step), int(rank), phase, action)


class Faults:
    """A member process's scripted kills: `before_step` runs before each step, `after_update`
    after each step's update, `hooks` go into its switches; `seen` is told each change the
    member is asked to prepare."""

    def __init__(self, name: str, kills: tuple[ScriptedKill, ...]) -> None:
        self.name, self.kills = name, kills
        self.member: Member | None = None
        self.change: Change | None = None  # the latest change asked of this member
        self._stores = threading.local()  # a store client per thread (prepare has its own)

    def seen(self, change: Change) -> None:
        self.change = change

    def before_step(self, member: Member) -> None:
        assert member.layout is not None
        self._hit("step", member.step, member.layout.rank_of(member.name))

    def after_update(self, member: Member) -> None:
        assert member.layout is not None
        self._hit("update", member.step - 1, member.layout.rank_of(member.name))

    def hooks(self) -> SwitchHooks:
        def at(phase: str) -> Callable[..., None]:
            def hit(*args: Any) -> None:
                change = self.change
                if change is not None and (phase != "transfer" or args == (0,)):
                    self._hit(phase, change.at_step, change.old.ranks.get(self.name))

            return hit

        return SwitchHooks(
            before_prepare=at("prepare"), before_round=at("transfer"), before_vote=at("vote"),
            before_decision=at("commit"),
        )  # fmt: skip

    def _hit(self, phase: str, step: int, rank: int | None) -> None:
        for kill in self.kills:
            if (kill.phase, kill.step, kill.rank) != (phase, step, rank):
                continue
            if self._store().add(keys.kill(step, kill.rank, phase), 1) != 1:
                continue  # once per job
            if kill.action is Fault.STALL:
                assert self.member is not None
                time.sleep(1.5 * self.member.deadlines.op)
            else:
                stop = kill.action is Fault.HANG
                os.kill(os.getpid(), signal.SIGSTOP if stop else signal.SIGKILL)

    def _store(self) -> Store:
        store = getattr(self._stores, "store", None)
        if store is None:
            assert self.member is not None
            store = self._stores.store = self.member.store.clone()
        return store


def combine(first: SwitchHooks | None, second: SwitchHooks) -> SwitchHooks:
    """Hooks that call `first`'s and then `second`'s at each point."""
    if first is None:
        return second
    merged: dict[str, Callable[..., None] | None] = {}
    for f in fields(SwitchHooks):
        a, b = getattr(first, f.name), getattr(second, f.name)
        merged[f.name] = _both(a, b) if a and b else a or b
    return replace(first, **merged)


def _both(a: Callable[..., None], b: Callable[..., None]) -> Callable[..., None]:
    def call(*args: Any) -> None:
        a(*args)
        b(*args)

    return call
