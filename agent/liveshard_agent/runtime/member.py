"""A member: one agent's part of a job across worlds: standing by, training, preparing the next
world in the background, switching to it at an agreed step, and checkpointing at agreed steps.

A reconfiguration (`Change`) reaches every member of the old and the new layout, each at its own
moment. Each starts preparing it in the background; members of the old world keep training. In
every step's last all-reduce (the loss's; no collective of its own) the old world's members add
up which epoch each has pending, at which step it may switch, and whether it is prepared or
failed; when all have the same change pending and prepared with the same switch step, and the
step has reached it, they switch at this boundary, all at the same step (the decision is computed
from the same reduced values everywhere). A change may be held (no switch step yet) and released
later (`set_switch_step`), or dropped (`drop`). The old world's rank 0 announces the step and the
training scalars in the store, so joining members (which do not train in the old world) switch
with them, and every member checks its own scalars against the announced ones before it votes. On
commit, members of the new layout train on from the same step in the new world; members that left
stand by. On abort (or when any member failed to prepare), everyone keeps the old world and the
reason is reported. Checkpoints are agreed the same way (the same checkpoint number pending
everywhere, its step reached), since saving one is a collective.

The store a change's members meet in is the member's `store` when the change is requested; the
caller sets it (`use_store`) for each epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed import ReduceOp, Store

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout
from liveshard_core.vps.spec import ModelSpec

from ..engine.checksum import Checksums
from ..engine.errors import Cause
from ..engine.record import context_logger
from ..engine.switch import Reconfiguration, SwitchHooks, SwitchResult, Timeouts
from ..engine.world import Axis, World
from . import checkpoint, comm
from .data import Dataset, load_corpus
from .settings import TrainingSettings
from .trainer import Scalars, StepRecord, Trainer, initial_state

log = logging.getLogger(__name__)

HELD = -1  # a change's switch step while it is held


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


@dataclass(frozen=True)
class SwitchEvent:
    """One member's account of one reconfiguration; `report` marks the member that speaks for
    the job (rank 0 of the world the job trains in afterwards)."""

    epoch: int
    step: int
    from_layout: str
    to_layout: str
    result: str  # committed or aborted
    cause: str | None
    reason: str
    pause_seconds: float  # the exposed pause: the last step before to the first step after (max)
    prepare_seconds: float  # request to prepared, on this member
    network_bytes: int
    report: bool
    checksums: dict[str, str] = field(default_factory=dict)  # before/after digests, if asked
    switch_seconds: dict[str, float] = field(default_factory=dict)  # the engine's parts, here

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CheckpointEvent:
    number: int
    step: int
    path: str
    seconds: float
    report: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Event = SwitchEvent | CheckpointEvent


@dataclass
class _Pending:
    change: Change
    reconfig: Reconfiguration
    future: Future[None]
    requested: float
    prepared: float | None = None


@dataclass(frozen=True)
class _Checkpoint:
    number: int
    path: str
    at_step: int


def _same(count: float, total: float, squares: float) -> bool:
    """Whether `count` values with this sum and sum of squares are all equal (Cauchy-Schwarz;
    exact in float64 for the small integers summed here)."""
    return count * squares == total * total


class Member:
    """One agent's member of a job: drives its trainer and its reconfigurations."""

    def __init__(
        self,
        *,
        name: str,
        spec: ModelSpec,
        settings: TrainingSettings,
        device: torch.device,
        store: Store | None = None,
        timeouts: Timeouts | None = None,
        hooks: SwitchHooks | None = None,
        job: str = "",
        checksums: bool = False,
    ) -> None:
        self.name, self.spec, self.settings = name, spec, settings
        self.device, self.job = device, job
        self._store = store
        self.timeouts = timeouts or Timeouts()
        self.hooks = hooks or SwitchHooks()
        self.checksums = checksums  # compare whole-state checksum totals around each switch
        self.dataset = Dataset(load_corpus(settings.data), settings.seq_len, settings.seed)
        self.trainer: Trainer | None = None
        self.epoch = -1
        self.pending: _Pending | None = None
        self.checkpoint_due: _Checkpoint | None = None
        self.last_loss: float | None = None
        self._announced: Scalars | None = None  # the scalars the switch's step was announced with
        self._agreement: tuple[float, ...] = ()  # the last step's summed readiness
        self._joining_since: float | None = None
        self.log = context_logger(log, job=job, epoch=self.epoch, member=name)

    # ---- state ----

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError(f"{self.name} has no store yet: no world or change was given one")
        return self._store

    def use_store(self, store: Store) -> None:
        """The store of the next world or change."""
        self._store = store

    @property
    def training(self) -> bool:
        return self.trainer is not None

    @property
    def joining(self) -> bool:
        return self.trainer is None and self.pending is not None

    @property
    def layout(self) -> Layout | None:
        return self.trainer.layout if self.trainer else None

    @property
    def step(self) -> int:
        return self.trainer.scalars.step if self.trainer else -1

    @property
    def done(self) -> bool:
        return self.trainer is not None and self.step >= self.settings.steps

    @property
    def speaks(self) -> bool:
        """Whether this member is rank 0 of the world it trains in."""
        return self.trainer is not None and self.trainer.layout.rank_of(self.name) == 0

    def start(self, layout: Layout, epoch: int = 0, scalars: Scalars | None = None) -> None:
        """Join the job's first world with the initial state."""
        world = self._world(layout, epoch)
        state = initial_state(
            self.spec, layout, layout.rank_of(self.name), self.settings.seed, self.device
        )
        self._train(state, world, scalars or Scalars(seed=self.settings.seed))

    def restore(self, layout: Layout, directory: str, epoch: int = 0) -> None:
        """Join a first world with the state and scalars of a checkpoint (written in any
        layout); every member of `layout` calls this."""
        world = self._world(layout, epoch)
        state, scalars = checkpoint.load(
            self.spec, layout, layout.rank_of(self.name), self.device, directory,
            store=self.store, prefix=f"liveshard/{epoch}/restore", timeout=self.timeouts.prepare,
        )  # fmt: skip
        self._train(state, world, scalars)

    def _world(self, layout: Layout, epoch: int) -> World:
        if self.trainer is not None:
            raise InvalidInput(f"{self.name} already trains in epoch {self.epoch}")
        self.settings.micro_batches(layout.dp)  # refuse a layout the global batch cannot fill
        self._set_epoch(epoch)
        return World.build(
            self.store, epoch=epoch, layout=layout, member=self.name, device=self.device,
            timeout=self.timeouts.op,
        )  # fmt: skip

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.log = context_logger(log, job=self.job, epoch=epoch, member=self.name)

    def _train(self, state: Any, world: World, scalars: Scalars) -> None:
        self.trainer = Trainer(
            state=state, world=world, settings=self.settings, dataset=self.dataset, scalars=scalars
        )

    # ---- training ----

    def train_step(self) -> StepRecord:
        """Train one step; its last all-reduce also carries this member's readiness for the
        pending change and checkpoint (see `at_boundary`)."""
        assert self.trainer is not None, f"{self.name} is standing by"
        record = self.trainer.step(self._readiness())
        self._agreement = record.agreement
        self.last_loss = record.loss
        return record

    def _readiness(self) -> tuple[float, ...]:
        pending, due = self.pending, self.checkpoint_due
        epoch = pending.change.epoch if pending else -1
        at_step = pending.change.at_step if pending else HELD
        done = pending is not None and pending.future.done()
        failed = done and pending is not None and pending.future.exception() is not None
        number = due.number if due else -1
        return (
            1.0, epoch, epoch * epoch, float(done and not failed), float(failed),
            at_step, at_step * at_step, number, number * number,
        )  # fmt: skip

    def at_boundary(self) -> list[Event]:
        """Called by every training member after every step: checkpoint and switch if due, as
        the values the step's all-reduce summed say (the same on every member)."""
        trainer = self.trainer
        assert trainer is not None, f"{self.name} is standing by"
        boundary = time.perf_counter()
        members, epochs, e2, ready, failed, at, at2, number, number2 = self._agreement
        events: list[Event] = []
        due = self.checkpoint_due
        agreed = due is not None and number >= 0 and _same(members, number, number2)
        if due is not None and agreed and trainer.scalars.step >= due.at_step:
            events.append(self._checkpoint(due))
        pending = self.pending
        if pending is None or epochs < 0 or not _same(members, epochs, e2):
            return events  # not every member has the same change pending yet
        epoch = pending.change.epoch
        if failed:
            events.append(self._give_up(f"{int(failed)} member(s) failed to prepare epoch {epoch}"))
            return events
        if ready < members or at < 0 or not _same(members, at, at2):
            return events
        if trainer.scalars.step < at / members:  # every member's switch step is the same
            return events
        if self.speaks:
            scalars = trainer.scalars.as_dict()
            self._announce(epoch, {"step": trainer.scalars.step, "scalars": scalars})
        announcement = self._announcement(epoch)
        assert announcement is not None and "scalars" in announcement
        self._announced = Scalars.from_dict(announcement["scalars"])
        events.append(self._switch(boundary))
        return events

    # ---- checkpoints ----

    def request_checkpoint(self, number: int, path: str, at_step: int) -> None:
        """Save checkpoint `number` to `path` at the first boundary at or after `at_step` at which
        every member of the world has asked for the same number."""
        if self.checkpoint_due is not None and self.checkpoint_due.number >= number:
            raise InvalidInput(
                f"checkpoint {number}: checkpoint {self.checkpoint_due.number} is still due"
            )
        self.checkpoint_due = _Checkpoint(number, path, at_step)

    def checkpoint(self, directory: str) -> float:
        """Save the job's state now (every member of the world calls this at the same
        boundary); returns the seconds it took."""
        trainer = self.trainer
        assert trainer is not None, f"{self.name} is standing by"
        start = time.perf_counter()
        checkpoint.save(
            trainer.state, trainer.scalars, self.settings, directory, store=self.store,
            prefix=f"liveshard/{self.epoch}/checkpoint/{trainer.scalars.step}",
            timeout=self.timeouts.prepare,
        )  # fmt: skip
        return time.perf_counter() - start

    def _checkpoint(self, due: _Checkpoint) -> CheckpointEvent:
        seconds = self.checkpoint(due.path)
        self.checkpoint_due = None
        return CheckpointEvent(due.number, self.step, due.path, round(seconds, 6), self.speaks)

    # ---- reconfiguration ----

    def request(self, change: Change) -> None:
        """Begin preparing `change` in the background (a member of either layout calls this)."""
        if self.pending is not None:
            raise InvalidInput(
                f"{self.name}: epoch {self.pending.change.epoch} is still pending; "
                f"epoch {change.epoch} must wait for it"
            )
        if change.epoch <= self.epoch:
            raise InvalidInput(
                f"{self.name}: epoch {change.epoch} is not after the current epoch {self.epoch}"
            )
        if self.trainer is not None and change.old != self.trainer.layout:
            raise InvalidInput(
                f"{self.name}: the change's old layout {change.old.describe()} is not the layout "
                f"in effect, {self.trainer.layout.describe()}"
            )
        self.settings.micro_batches(change.new.dp)  # refuse a layout the global batch cannot fill
        reconfig = Reconfiguration(
            spec=self.spec, old=change.old, new=change.new, member=self.name, store=self.store,
            epoch=change.epoch, device=self.device, budget=change.budget, timeouts=self.timeouts,
            lost=change.lost, verify=change.verify, job=self.job,
            hooks=SwitchHooks(self.hooks.before_round, self._before_vote),
        )  # fmt: skip
        self.pending = _Pending(
            change, reconfig, reconfig.prepare_in_background(), time.perf_counter()
        )
        self.pending.future.add_done_callback(self._mark_prepared)
        self._announced = None
        self._joining_since = None

    def set_switch_step(self, epoch: int, at_step: int) -> None:
        """Let the pending change `epoch` switch at the first boundary at or after `at_step`."""
        pending = self._pending_epoch(epoch)
        pending.change = dataclasses.replace(pending.change, at_step=at_step)

    def drop(
        self, epoch: int, reason: str = "dropped on request", cause: Cause = Cause.VOTE_NO
    ) -> SwitchEvent:
        """Give up the pending change `epoch` before its switch; joining members waiting for its
        announcement are told. Safe at any moment: a switch needs every member to have it."""
        pending = self._pending_epoch(epoch)
        self.pending = None
        pending.reconfig.abort()
        if self.speaks:
            self._announce(epoch, {"abort": reason})
        return self._event(pending, "aborted", cause, reason, 0.0, self.speaks, {})

    def abandon(self) -> None:
        """Drop a pending change that will never be switched (the job ended first)."""
        if self.pending is not None:
            self.drop(self.pending.change.epoch, "the job ended before the switch")

    def _pending_epoch(self, epoch: int) -> _Pending:
        if self.pending is None or self.pending.change.epoch != epoch:
            have = self.pending.change.epoch if self.pending else None
            raise InvalidInput(f"{self.name}: epoch {epoch} is not pending (pending: {have})")
        return self.pending

    def _mark_prepared(self, _: Future[None]) -> None:
        if self.pending is not None:
            self.pending.prepared = time.perf_counter()

    def _before_vote(self) -> None:
        if self.hooks.before_vote is not None:
            self.hooks.before_vote()
        if self.trainer is not None and self._announced is not None:
            mine = self.trainer.scalars
            if mine != self._announced:
                raise RuntimeError(
                    f"training scalars {mine} differ from the announced {self._announced}"
                )

    def join(self) -> SwitchEvent | None:
        """Called repeatedly by a member that is not in the old world: switch with the others
        once the step is announced; None while it is not (yet). A joining member waits at most
        the prepare deadline after its own prepare ended."""
        pending = self.pending
        assert pending is not None and self.trainer is None
        if not pending.future.done():
            return None
        start = time.perf_counter()
        if pending.future.exception() is not None:
            # The old world's members see the failure too and drop the change.
            error = pending.future.exception()
            self.pending = None
            cause = getattr(error, "cause", None)
            return self._event(pending, "aborted", cause, f"prepare failed: {error}", 0, False, {})
        announcement = self._announcement(pending.change.epoch, wait=False)
        if announcement is None:
            self._joining_since = self._joining_since or start
            if start - self._joining_since < self.timeouts.prepare:
                return None
            announcement = {"abort": f"no switch was announced within {self.timeouts.prepare} s"}
        if "abort" in announcement:
            return self.drop(pending.change.epoch, announcement["abort"])
        self._announced = Scalars.from_dict(announcement["scalars"])
        return self._switch(start)

    def _announce(self, epoch: int, content: dict[str, Any]) -> None:
        self.store.set(f"liveshard/{epoch}/announce", json.dumps(content))

    def _announcement(self, epoch: int, wait: bool = True) -> dict[str, Any] | None:
        key = f"liveshard/{epoch}/announce"
        if not wait and not self.store.check([key]):
            return None
        return dict(json.loads(self.store.get(key)))  # get waits up to the store's timeout

    def _give_up(self, reason: str) -> SwitchEvent:
        """Every old member drops the pending change (some member failed to prepare)."""
        pending = self.pending
        assert pending is not None
        own = pending.future.exception() if pending.future.done() else None
        cause = getattr(own, "cause", None) or Cause.VOTE_NO
        return self.drop(pending.change.epoch, f"{reason}: {own}" if own else reason, cause)

    def _switch(self, boundary: float) -> SwitchEvent:
        pending, trainer = self.pending, self.trainer
        assert pending is not None
        change = pending.change
        digests: dict[str, str] = {}
        if self.checksums and trainer is not None:
            digests["before"] = self._checksum_digest(trainer.state, trainer.world)
        old_state = trainer.state if trainer is not None else None
        result: SwitchResult = pending.reconfig.switch(old_state)
        self.pending = None
        if not result.committed:
            assert trainer is not None and result.state is not None
            trainer.bind(result.state, trainer.world)  # the same state, kept as it was
            pause = self._max_over_world(time.perf_counter() - boundary)
            return self._event(
                pending, "aborted", result.cause, result.reason, pause, self.speaks, digests,
                result,
            )  # fmt: skip
        self._set_epoch(change.epoch)
        if result.state is None or result.world is None:  # this member left
            self.trainer = None
            return self._event(
                pending, "committed", None, result.reason, 0.0, False, digests, result
            )
        if trainer is not None:
            trainer.bind(result.state, result.world)
        else:
            assert self._announced is not None
            self._train(result.state, result.world, self._announced)
        if self.checksums:
            digests["after"] = self._checksum_digest(result.state, result.world)
        pause = self._max_over_world(time.perf_counter() - boundary)
        return self._event(
            pending, "committed", None, result.reason, pause, self.speaks, digests, result
        )

    # ---- helpers ----

    def _max_over_world(self, seconds: float) -> float:
        if self.trainer is None:
            return seconds
        value = torch.tensor([seconds], dtype=torch.float64)
        comm.all_reduce(value, self.trainer.world.group(Axis.WORLD), ReduceOp.MAX)
        return float(value)

    def _checksum_digest(self, state: Any, world: World) -> str:
        """A digest of the whole state's checksum totals over `world` (layout-independent)."""
        sums = Checksums.of_state(state)
        comm.all_reduce(sums.sums, world.group(Axis.WORLD))
        return hashlib.sha256(repr(sums.reduced().tolist()).encode()).hexdigest()[:16]

    def _event(
        self,
        pending: _Pending,
        result: str,
        cause: Cause | None,
        reason: str,
        pause: float,
        report: bool,
        digests: dict[str, str],
        outcome: SwitchResult | None = None,
    ) -> SwitchEvent:
        change = pending.change
        prepared = pending.prepared or time.perf_counter()
        seconds = outcome.seconds if outcome else {}
        return SwitchEvent(
            epoch=change.epoch,
            step=self.step,
            from_layout=change.old.describe(),
            to_layout=change.new.describe(),
            result=result,
            cause=cause.value if cause else None,
            reason=reason,
            pause_seconds=round(pause, 6),
            prepare_seconds=round(prepared - pending.requested, 6),
            network_bytes=pending.reconfig.network_bytes,
            report=report,
            checksums=digests,
            switch_seconds={k: round(v, 6) for k, v in seconds.items()},
        )
