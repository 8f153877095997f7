"""A member: one agent's part of a job across worlds: standing by, training, preparing the next
world in the background, and switching to it at an agreed step.

A reconfiguration (`Change`) reaches every member of the old and the new layout, each at its own
moment. Each starts preparing it in the background; members of the old world keep training. In
every step's last all-reduce (the loss's; no collective of its own) the old world's members add
up which epoch each has pending and whether it is prepared or failed; when all have the same
change pending and prepared, and the step has reached its `at_step`, they switch at this
boundary, all at the same step (the decision is computed from the same reduced values
everywhere). The old world's rank 0 announces the step and the training scalars in the store, so
joining members (which do not train in the old world) switch with them, and every member checks
its own scalars against the announced ones before it votes. On commit, members of the new layout
train on from the same step in the new world; members that left stand by. On abort (or when any
member failed to prepare), everyone keeps the old world and the reason is reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp, Store

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


@dataclass(frozen=True)
class Change:
    """A reconfiguration from the layout in effect (`old`) to `new`, as epoch `epoch`."""

    epoch: int
    old: Layout
    new: Layout
    at_step: int = 0  # switch at the first step boundary >= this where every member is prepared
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


@dataclass
class _Pending:
    change: Change
    reconfig: Reconfiguration
    future: Future[None]
    requested: float
    prepared: float | None = None


class Member:
    """One agent's member of a job: drives its trainer and its reconfigurations."""

    def __init__(
        self,
        *,
        name: str,
        spec: ModelSpec,
        settings: TrainingSettings,
        store: Store,
        device: torch.device,
        timeouts: Timeouts | None = None,
        hooks: SwitchHooks | None = None,
        job: str = "",
        checksums: bool = False,
    ) -> None:
        self.name, self.spec, self.settings, self.store = name, spec, settings, store
        self.device, self.job = device, job
        self.timeouts = timeouts or Timeouts()
        self.hooks = hooks or SwitchHooks()
        self.checksums = checksums  # compare whole-state checksum totals around each switch
        self.dataset = Dataset(load_corpus(settings.data), settings.seq_len, settings.seed)
        self.trainer: Trainer | None = None
        self.epoch = -1
        self.pending: _Pending | None = None
        self._announced: Scalars | None = None  # the scalars the switch's step was announced with
        self._agreement: tuple[float, ...] = ()  # the last step's summed readiness
        self.log = context_logger(log, job=job, epoch=self.epoch, member=name)

    # ---- state ----

    @property
    def training(self) -> bool:
        return self.trainer is not None

    @property
    def layout(self) -> Layout | None:
        return self.trainer.layout if self.trainer else None

    @property
    def step(self) -> int:
        return self.trainer.scalars.step if self.trainer else -1

    @property
    def done(self) -> bool:
        return self.trainer is not None and self.step >= self.settings.steps

    def start(self, layout: Layout, epoch: int = 0, scalars: Scalars | None = None) -> None:
        """Join the job's first world (or one restored from a checkpoint) with the initial state."""
        world = self._world(layout, epoch)
        state = initial_state(
            self.spec, layout, layout.rank_of(self.name), self.settings.seed, self.device
        )
        self._train(state, world, scalars or Scalars(seed=self.settings.seed))

    def _world(self, layout: Layout, epoch: int) -> World:
        self.epoch = epoch
        return World.build(
            self.store, epoch=epoch, layout=layout, member=self.name, device=self.device,
            timeout=self.timeouts.op,
        )  # fmt: skip

    def _train(self, state: Any, world: World, scalars: Scalars) -> None:
        self.trainer = Trainer(
            state=state, world=world, settings=self.settings, dataset=self.dataset, scalars=scalars
        )

    def restore(self, layout: Layout, directory: str, epoch: int = 0) -> None:
        """Join a first world with the state and scalars of a checkpoint (written in any
        layout); every member of `layout` calls this."""
        world = self._world(layout, epoch)
        state, scalars = checkpoint.load(
            self.spec, layout, layout.rank_of(self.name), self.device, directory,
            store=self.store, prefix=f"liveshard/{epoch}/restore", timeout=self.timeouts.prepare,
        )  # fmt: skip
        self._train(state, world, scalars)

    def checkpoint(self, directory: str) -> float:
        """Save the job's state (every member of the world calls this at the same boundary);
        returns the seconds it took."""
        trainer = self.trainer
        assert trainer is not None, f"{self.name} is standing by"
        start = time.perf_counter()
        checkpoint.save(
            trainer.state, trainer.scalars, self.settings, directory, store=self.store,
            prefix=f"liveshard/{self.epoch}/checkpoint/{trainer.scalars.step}",
            timeout=self.timeouts.prepare,
        )  # fmt: skip
        return time.perf_counter() - start

    def train_step(self) -> StepRecord:
        """Train one step; its last all-reduce also carries this member's readiness for the
        pending change (see `at_boundary`)."""
        assert self.trainer is not None, f"{self.name} is standing by"
        pending = self.pending
        epoch = pending.change.epoch if pending else -1
        done = pending is not None and pending.future.done()
        failed = done and pending is not None and pending.future.exception() is not None
        # Equal epochs everywhere iff n * sum(e^2) == sum(e)^2; exact in float64 for such ints.
        record = self.trainer.step(
            (1.0, epoch, epoch * epoch, float(done and not failed), float(failed))
        )
        self._agreement = record.agreement
        return record

    # ---- reconfiguration ----

    def request(self, change: Change) -> None:
        """Begin preparing `change` in the background (a member of either layout calls this)."""
        if self.pending is not None:
            raise RuntimeError(
                f"{self.name}: epoch {self.pending.change.epoch} is still pending; "
                f"epoch {change.epoch} must wait for it"
            )
        reconfig = Reconfiguration(
            spec=self.spec, old=change.old, new=change.new, member=self.name, store=self.store,
            epoch=change.epoch, device=self.device, budget=change.budget, timeouts=self.timeouts,
            lost=change.lost, verify=change.verify, job=self.job,
            hooks=SwitchHooks(self.hooks.before_round, self._before_vote),
        )  # fmt: skip
        self.settings.micro_batches(change.new.dp)  # refuse a layout the global batch cannot fill
        self.pending = _Pending(
            change, reconfig, reconfig.prepare_in_background(), time.perf_counter()
        )
        self.pending.future.add_done_callback(self._mark_prepared)
        self._announced = None

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

    def at_boundary(self) -> SwitchEvent | None:
        """Called by every training member after every step: switch if the pending change is
        due, as the values the step's all-reduce summed say (the same on every member)."""
        pending, trainer = self.pending, self.trainer
        assert trainer is not None, f"{self.name} is standing by"
        boundary = time.perf_counter()
        members, epochs, squares, ready, failed = self._agreement
        if pending is None or members * squares != epochs * epochs or epochs < 0:
            return None  # not every member has the same change pending yet
        epoch = pending.change.epoch
        if failed:
            return self._give_up(f"{int(failed)} member(s) failed to prepare epoch {epoch}")
        if ready < members or trainer.scalars.step < pending.change.at_step:
            return None
        if trainer.layout.rank_of(self.name) == 0:
            scalars = trainer.scalars.as_dict()
            self._announce(epoch, {"step": trainer.scalars.step, "scalars": scalars})
        self._announced = Scalars.from_dict(self._read_announcement()["scalars"])
        return self._switch(boundary)

    def join(self) -> SwitchEvent:
        """Called by a member that is not in the old world: wait for the announced step (or the
        abort), then switch with the others."""
        pending = self.pending
        assert pending is not None and self.trainer is None
        start = time.perf_counter()
        try:
            pending.future.result()
        except Exception as err:
            # The old world's members see the failure too and abort; nothing to switch.
            return self._finish_aborted(
                f"prepare failed: {err}", getattr(err, "cause", None), start
            )
        announcement = self._read_announcement()
        if "abort" in announcement:
            pending.reconfig.abort()
            return self._finish_aborted(announcement["abort"], Cause.VOTE_NO, start)
        self._announced = Scalars.from_dict(announcement["scalars"])
        return self._switch(time.perf_counter())

    def _announce(self, epoch: int, content: dict[str, Any]) -> None:
        self.store.set(f"liveshard/{epoch}/announce", json.dumps(content))

    def _read_announcement(self) -> dict[str, Any]:
        assert self.pending is not None
        key = f"liveshard/{self.pending.change.epoch}/announce"
        self.store.wait([key], timedelta(seconds=self.timeouts.prepare))
        return dict(json.loads(self.store.get(key)))

    def _give_up(self, reason: str) -> SwitchEvent:
        """Every old member abandons the pending change (some member failed to prepare)."""
        pending, trainer = self.pending, self.trainer
        assert pending is not None and trainer is not None
        start = time.perf_counter()
        try:
            pending.future.result()  # bounded by the prepare deadline
            own: Exception | None = None
        except Exception as err:
            own = err
        pending.reconfig.abort()
        if trainer.layout.rank_of(self.name) == 0:
            self._announce(pending.change.epoch, {"abort": reason})
        cause = getattr(own, "cause", None) or Cause.VOTE_NO
        return self._finish_aborted(f"{reason}: {own}" if own else reason, cause, start)

    def _finish_aborted(self, reason: str, cause: Cause | None, start: float) -> SwitchEvent:
        pending = self.pending
        assert pending is not None
        self.pending = None
        report = self.trainer is not None and self.trainer.layout.rank_of(self.name) == 0
        pause = self._max_over_world(time.perf_counter() - start)
        return self._event(pending, "aborted", cause, reason, pause, report, {})

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
            trainer.bind(result.state, trainer.world)  # the same state object, kept as it was
            pause = self._max_over_world(time.perf_counter() - boundary)
            report = trainer.layout.rank_of(self.name) == 0
            return self._event(
                pending, "aborted", result.cause, result.reason, pause, report, digests
            )
        self.epoch = change.epoch
        self.log = context_logger(log, job=self.job, epoch=self.epoch, member=self.name)
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
        report = change.new.rank_of(self.name) == 0
        return self._event(
            pending, "committed", None, result.reason, pause, report, digests, result
        )

    def abandon(self) -> None:
        """Drop a pending change that will never be switched (the job ended first); joining
        members waiting for its announcement are told."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except Exception:
            pass  # a failed prepare has nothing left to drop
        else:
            pending.reconfig.abort()
        if self.trainer is not None and self.trainer.layout.rank_of(self.name) == 0:
            self._announce(pending.change.epoch, {"abort": "the job ended before the switch"})

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
        plan = pending.reconfig.plan
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
            network_bytes=plan.network_bytes if plan is not None else 0,
            report=report,
            checksums=digests,
            switch_seconds={
                k: round(v, 6) for k, v in (outcome.seconds if outcome else {}).items()
            },
        )
