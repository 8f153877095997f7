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

A world breaks when one of its collectives fails (a member died without notice, or timed out):
the member aborts its groups, so that members still waiting on it fail at once too, keeps its
state (`Breakage` says at which step, and whether an update was cut in half), drops a pending
change that needed the old world to agree, and waits for a recovery: a change naming the dead
members `lost`, whose plan takes their bytes from surviving copies. As the old world cannot agree
on anything any more, the survivors meet in the recovery's store instead: each publishes where
its world broke, and the lowest-ranked survivor announces the switch at their common step, or an
abort when their states differ (some took the step's update and some did not; an update was cut
in half) and only a checkpoint can restore the job. A change with lost members supersedes a
pending one, and never switches through the old world.

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

from liveshard_core.errors import InvalidInput, NoSurvivingCopy
from liveshard_core.job import Deadlines, TrainingSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.vps.spec import ModelSpec

from ..engine.checksum import Checksums
from ..engine.errors import Cause
from ..engine.record import context_logger
from ..engine.switch import Reconfiguration, SwitchHooks, SwitchResult
from ..engine.world import Axis, World, close_in_background
from . import checkpoint, comm
from .data import Dataset, load_corpus
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
    lost: list[str] = field(default_factory=list)  # old members that died, for a recovery
    checksums: dict[str, str] = field(default_factory=dict)  # before/after digests, if asked
    switch_seconds: dict[str, float] = field(default_factory=dict)  # the engine's parts, here

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Breakage:
    """Where a member's world broke: the member keeps its state for a recovery."""

    step: int  # the next step to train: the state holds every update before it
    whole: bool  # False: the failure cut an update in half; only a checkpoint restores the job
    reason: str
    unfinished: bool = False  # step `step`'s update can be completed with the others' sums

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
    published: bool = False  # a broken member told the recovery's store where its world broke


@dataclass(frozen=True)
class _Checkpoint:
    number: int
    path: str
    at_step: int


def recovery_decision(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the first survivor of a broken world announces, from every survivor's report (its
    scalars, whether its state is whole, whether it can finish its step's update alone, and the
    values its last update summed): the switch at the survivors' last step, with the values that
    let those one update behind finish it (a peer died inside the update's all-reduce, which
    completed at some members only), or an abort saying why there is no common state."""
    cut = [m for m, r in reports.items() if not r["whole"]]
    steps = {m: r["scalars"]["step"] for m, r in reports.items()}
    last = max(steps.values())
    ahead = [r for r in reports.values() if r["scalars"]["step"] == last]
    behind = [m for m, step in steps.items() if step != last]
    stuck = [m for m in behind if steps[m] != last - 1 or not reports[m]["unfinished"]]
    if cut:
        why = f"the world broke in the middle of an update at {cut}: their state is half-done"
    elif stuck or (behind and not ahead[0]["summed"]):
        why = f"the survivors stopped at steps {steps}, and {stuck or behind} cannot catch up"
    elif len({json.dumps(r["scalars"], sort_keys=True) for r in ahead}) > 1:
        why = f"the survivors at step {last} disagree on the training scalars"
    else:
        announcement = {"step": last, "scalars": ahead[0]["scalars"]}
        if behind:
            announcement["finish"] = ahead[0]["summed"]
        return announcement
    return {
        "abort": f"no common state in memory: {why}; restore from a checkpoint",
        "cause": Cause.NO_COMMON_STATE.value,
    }


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
        deadlines: Deadlines | None = None,
        hooks: SwitchHooks | None = None,
        job: str = "",
        checksums: bool = False,
    ) -> None:
        self.name, self.spec, self.settings = name, spec, settings
        self.device, self.job = device, job
        self._store = store
        self.deadlines = deadlines or Deadlines()
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
        self.broken: Breakage | None = None
        self._broken_at = 0.0
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
    def recovering(self) -> bool:
        """Whether this member's world broke and a recovery is pending."""
        return self.broken is not None and self.pending is not None

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
            store=self.store, prefix=f"liveshard/{epoch}/restore", timeout=self.deadlines.prepare,
        )  # fmt: skip
        self._train(state, world, scalars)

    def _world(self, layout: Layout, epoch: int) -> World:
        if self.trainer is not None and self.broken is None:
            raise InvalidInput(f"{self.name} already trains in epoch {self.epoch}")
        self.trainer, self.broken = None, None  # a broken world's state: a new world replaces it
        self.settings.micro_batches(layout.dp)  # refuse a layout the global batch cannot fill
        self._set_epoch(epoch)
        return World.build(
            self.store, epoch=epoch, layout=layout, member=self.name, device=self.device,
            timeout=self.deadlines.op,
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
        if pending.change.lost:
            return events  # a recovery: the old world will break, its survivors meet in the store
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
        assert announcement is not None
        if "abort" in announcement:  # announced first by a member that could not go on
            events.append(self.drop(epoch, announcement["abort"]))
            return events
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
            timeout=self.deadlines.prepare,
        )  # fmt: skip
        return time.perf_counter() - start

    def _checkpoint(self, due: _Checkpoint) -> CheckpointEvent:
        seconds = self.checkpoint(due.path)
        self.checkpoint_due = None
        return CheckpointEvent(due.number, self.step, due.path, round(seconds, 6), self.speaks)

    # ---- reconfiguration ----

    def request(self, change: Change) -> list[SwitchEvent]:
        """Begin preparing `change` in the background (a member of either layout calls this).
        A change with lost members supersedes a pending change: the events of those dropped."""
        broken = self.broken
        if broken is not None and not change.lost:
            raise InvalidInput(
                f"{self.name}: the world broke at step {broken.step} ({broken.reason}); only a "
                "recovery (a change with lost members) can follow"
            )
        superseded = []
        pending = self.pending
        if pending is not None and change.lost and change.epoch > pending.change.epoch:
            superseded.append(
                self.drop(pending.change.epoch, f"superseded by the recovery epoch {change.epoch}")
            )
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
            epoch=change.epoch, device=self.device, budget=change.budget, deadlines=self.deadlines,
            lost=change.lost, verify=change.verify, job=self.job,
            hooks=SwitchHooks(self.hooks.before_round, self._before_vote),
        )  # fmt: skip
        self.pending = _Pending(
            change, reconfig, reconfig.prepare_in_background(), time.perf_counter()
        )
        self.pending.future.add_done_callback(self._mark_prepared)
        self._announced = None
        self._joining_since = None
        return superseded

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
        if self.speaks or self.broken is not None:
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
        """Called repeatedly by a member that is not in the old world, or whose world broke:
        switch with the others once the step is announced; None while it is not (yet). A joining
        member waits at most the prepare deadline after its own prepare ended."""
        pending = self.pending
        assert pending is not None and (self.trainer is None or self.broken is not None)
        if not pending.future.done():
            return None
        start = time.perf_counter()
        if pending.future.exception() is not None:
            # The old world's members see the failure too and drop the change; in a recovery,
            # the announcement tells the others.
            error = pending.future.exception()
            self.pending = None
            cause = getattr(error, "cause", None)
            if isinstance(error, NoSurvivingCopy):
                cause = Cause.NO_SURVIVING_COPY
            reason = f"prepare failed: {error}"
            if self.broken is not None:
                said = {"abort": f"{self.name}: {reason}", "cause": (cause or Cause.VOTE_NO).value}
                self._announce(pending.change.epoch, said)
            return self._event(pending, "aborted", cause, reason, 0, False, {})
        if self.broken is not None:
            self._publish_breakage(pending)
            self._decide_recovery(pending.change)
        announcement = self._announcement(pending.change.epoch, wait=False)
        if announcement is None:
            self._joining_since = self._joining_since or start
            if start - self._joining_since < self.deadlines.prepare:
                return None
            announcement = {"abort": f"no switch was announced within {self.deadlines.prepare} s"}
        if "abort" in announcement:
            cause = Cause(announcement.get("cause", Cause.VOTE_NO.value))
            return self.drop(pending.change.epoch, announcement["abort"], cause)
        self._announced = Scalars.from_dict(announcement["scalars"])
        trainer = self.trainer
        if trainer is not None and trainer.scalars.step < self._announced.step:
            self.log.info("one update behind the other survivors: finishing step %s with their "
                          "sums", trainer.scalars.step)  # fmt: skip
            trainer.finish_step(tuple(announcement["finish"]))
        return self._switch(self._broken_at if self.broken is not None else start)

    def _announce(self, epoch: int, content: dict[str, Any]) -> None:
        """Announce a switch or an abort; the first announcement of an epoch stands, so every
        member reads the same one."""
        self.store.compare_set(f"liveshard/{epoch}/announce", "", json.dumps(content))

    # ---- recovery from a broken world ----

    def break_world(self, error: BaseException) -> tuple[Breakage, list[SwitchEvent]]:
        """The world failed under this member (a collective raised: a peer died or timed out).
        Close its groups, so that members still waiting on them fail at once too; keep the state
        for a recovery; drop a pending change that needed the old world to agree."""
        trainer = self.trainer
        assert trainer is not None, f"{self.name} is standing by"
        reason = f"{type(error).__name__}: {error}".split("\n")[0]
        self.broken = Breakage(
            trainer.scalars.step, trainer.whole, reason, trainer.optimizer.can_finish
        )
        self._broken_at = time.perf_counter()
        self.log.warning("the world broke at step %s (%s): %s", self.broken.step,
                         "state whole" if self.broken.whole else "update cut", reason)  # fmt: skip
        # Destroying a gloo group closes its connections (aborting it does not): the members
        # waiting on this one fail now, not at their collective's timeout.
        groups = list(trainer.world.groups.values())
        trainer.world.groups.clear()
        close_in_background(groups)
        pending = self.pending
        if pending is None or pending.change.lost:
            return self.broken, []
        dropped = self.drop(pending.change.epoch, f"the world broke: {reason}", Cause.PEER_FAILED)
        return self.broken, [dropped]

    def _publish_breakage(self, pending: _Pending) -> None:
        if pending.published or self.broken is None or self.trainer is None:
            return
        report = {"scalars": self.trainer.scalars.as_dict(), **self.broken.as_dict(),
                  "summed": list(self.trainer.optimizer.summed)}  # fmt: skip
        self.store.set(f"liveshard/{pending.change.epoch}/broken/{self.name}", json.dumps(report))
        pending.published = True

    def _decide_recovery(self, change: Change) -> None:
        """The lowest-ranked survivor announces the recovery once every survivor has said where
        its world broke (`recovery_decision`): the switch at their last step, or an abort saying
        why there is no common state (then only a checkpoint restores the job)."""
        survivors = [m for m in change.old.members if m not in change.lost]
        if self.name != survivors[0]:
            return
        keys = {m: f"liveshard/{change.epoch}/broken/{m}" for m in survivors}
        if not self.store.check(list(keys.values())):
            if time.perf_counter() - self._broken_at < self.deadlines.prepare:
                return
            missing = [m for m, key in keys.items() if not self.store.check([key])]
            self._announce(change.epoch, {
                "abort": f"survivors {missing} did not say where their world broke within "
                         f"{self.deadlines.prepare} s", "cause": Cause.DEADLINE_PASSED.value,
            })  # fmt: skip
            return
        reports = {m: json.loads(self.store.get(key)) for m, key in keys.items()}
        self._announce(change.epoch, recovery_decision(reports))

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
        if self.checksums and trainer is not None and self.broken is None:
            digests["before"] = self._checksum_digest(trainer.state, trainer.world)
        old_state = trainer.state if trainer is not None else None
        result: SwitchResult = pending.reconfig.switch(old_state)
        self.pending = None
        if not result.committed:
            assert trainer is not None and result.state is not None
            if self.broken is None or result.state is not trainer.state:
                trainer.bind(result.state, trainer.world)  # the same state, kept as it was
            elapsed = time.perf_counter() - boundary
            pause = elapsed if self.broken is not None else self._max_over_world(elapsed)
            return self._event(
                pending, "aborted", result.cause, result.reason, pause, self.speaks, digests,
                result,
            )  # fmt: skip
        self._set_epoch(change.epoch)
        self.broken = None
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
            lost=sorted(change.lost),
            checksums=digests,
            switch_seconds={k: round(v, 6) for k, v in seconds.items()},
        )
