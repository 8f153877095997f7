"""A change as one member holds it: the request (`Change`), its preparation in the background
(`Pending`), the member's account of it once settled (`Pending.settled`, an `events.Switched`),
and what the member measures around its switch (the world's pause, the state's digest).

The member (`member.Member`) decides when a change switches or is dropped; this module keeps what
a change needs to be reported and must not decide anything.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed import ReduceOp

from liveshard_core.errors import NoSurvivingCopy
from liveshard_core.job import Cause, Result
from liveshard_core.layout.layout import Layout
from liveshard_core.plan.union import Pods

from ..engine.checksum import Checksums
from ..engine.state import ShardedState
from ..engine.switch import Reconfiguration, SwitchResult
from ..engine.world import Axis, World
from . import comm
from .agreement import NONE
from .events import Switched
from .trainer import Scalars

HELD = NONE  # a change's switch step while it is held


@dataclass(frozen=True)
class Change:
    """A reconfiguration from the layout in effect (`old`) to `new`, as epoch `epoch`."""

    epoch: int
    old: Layout
    new: Layout
    at_step: int = 0  # switch at the first boundary >= this where all are prepared; HELD: wait
    lost: frozenset[str] = frozenset()
    budget: int = 256 << 20
    verify: bool = True
    pods: Pods = field(default_factory=dict)  # the pod of members that share one


@dataclass(frozen=True)
class Unsettled:
    """A switch whose decision this member could not read: when its pause began, and the
    digests taken before it, for the account it gives once told."""

    boundary: float
    digests: dict[str, str]


@dataclass
class Pending:
    """A change this member prepares, or has prepared, and has not settled yet."""

    change: Change
    reconfig: Reconfiguration
    future: Future[None]
    requested: float  # time.perf_counter() at the request
    prepared: float | None = None  # and when its prepare ended
    announced: Scalars | None = None  # the scalars its switch step was announced with
    waiting_since: float | None = None  # a joining member's first look for the announcement
    published: bool = False  # a broken member told the recovery's store where its world broke
    undecided: Unsettled | None = None  # switched, its decision unread (`Member.decided`)

    def failure(self) -> tuple[str, Cause | None] | None:
        """Why its prepare failed, and the cause a switch would abort with; None if it did not
        (or has not ended)."""
        error = self.future.exception() if self.future.done() else None
        if error is None:
            return None
        if isinstance(error, NoSurvivingCopy):
            return f"prepare failed: {error}", Cause.NO_SURVIVING_COPY
        return f"prepare failed: {error}", getattr(error, "cause", None)

    def settled(
        self,
        *,
        step: int,
        result: Result,
        cause: Cause | None,
        reason: str,
        pause: float,
        report: bool,
        digests: dict[str, str],
        outcome: SwitchResult | None = None,
    ) -> Switched:
        """This member's account of the change, settled at `step` (`outcome`: the switch's, if
        it ran)."""
        change = self.change
        prepared = self.prepared or time.perf_counter()
        seconds = outcome.seconds if outcome else {}
        return Switched(
            epoch=change.epoch,
            step=step,
            from_layout=change.old.describe(),
            to_layout=change.new.describe(),
            result=result,
            cause=cause,
            reason=reason,
            pause_seconds=round(pause, 6),
            prepare_seconds=round(prepared - self.requested, 6),
            network_bytes=self.reconfig.network_bytes,
            report=report,
            lost=tuple(sorted(change.lost)),
            checksums=digests,
            switch_seconds={k: round(v, 6) for k, v in seconds.items()},
        )


def max_over_world(world: World | None, seconds: float) -> float:
    """The longest of every member's `seconds` over `world` (a member in no world: its own; and
    when a member of the world died after the switch was decided, its own: the world is closed
    (`closes_on_failure`), and the next step breaks it here)."""
    if world is None:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=world.device)
    try:
        with closes_on_failure(world):
            comm.all_reduce(value, world.group(Axis.WORLD), ReduceOp.MAX)
    except RuntimeError:  # torch's: a peer is gone
        return seconds
    return float(value)


def state_digest(state: ShardedState, world: World) -> str:
    """A digest of the whole state's checksum totals over `world` (layout-independent); raises
    torch's RuntimeError, the world closed, when a peer is gone."""
    sums = Checksums.of_state(state)
    with closes_on_failure(world):
        comm.all_reduce(sums.sums, world.group(Axis.WORLD))
    return hashlib.sha256(repr(sums.reduced().tolist()).encode()).hexdigest()[:16]


@contextmanager
def closes_on_failure(world: World) -> Iterator[None]:
    """Close `world` as a collective of the block fails (a peer is gone), so that the members
    still waiting in one of its collectives fail at once too, not at the op deadline. A member
    must run no other collective on a world once one failed: gloo's groups close their
    connections only once idle, and the peers of one left waiting would wait it out."""
    try:
        yield
    except RuntimeError as err:
        world.close(f"{type(err).__name__}: {err}".split("\n")[0])
        raise
