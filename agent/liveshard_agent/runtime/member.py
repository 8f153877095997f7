"""A member: one agent's part of a job across worlds: standing by, training, preparing the next
world in the background, switching to it at an agreed step, and checkpointing at agreed steps.

A reconfiguration (`change.Change`) reaches every member of the old and the new layout, each at
its own moment. Each starts preparing it in the background; members of the old world keep
training, and add their readiness to every step's last all-reduce (`agreement`): when all have
the same change prepared with the same switch step, and the step has reached it, they switch at
this boundary, all at the same step. A change may be held (no switch step yet) and released later
(`set_switch_step`), or dropped (`drop`). The old world's rank 0 announces the step and the
training scalars (`announcement`), so joining members switch with them, and every member checks
its own scalars against the announced ones before it votes. On commit, members of the new layout
train on from the same step in the new world; members that left stand by. On abort (or when any
member failed to prepare), everyone keeps the old world and the reason is reported. A member
that switched but could not read the decision (its store failed) is undecided: it keeps both
states until told (`decided`), and says how a switch ended (`on_decided`) before the collectives
that close it, so that whoever tells an undecided peer can see it. Checkpoints are agreed the
same way as switches, since saving one is a collective.

A world breaks when one of its collectives fails: the member closes its groups, so that members
still waiting on it fail at once too, keeps its state, drops a pending change that needed the old
world to agree, and waits for a recovery (a change naming the dead members `lost`), whose
survivors meet in its store (`recovery`). A recovery supersedes a pending change.

What a member is doing is its `state` (`MemberState`), read from what it holds: a trainer (a
world), a pending change, a breakage. The store a change's members meet in is the member's
`store` when the change is requested; the caller sets it (`use_store`) for each epoch. What the
members act on there is sealed with the job's `seal` (`engine.sealed`), which the caller gives
from the job's credential; a value without it is refused, and the change it belongs to is given
up. This module drives the member; it returns what happened as `events` and must not print or
send them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.distributed import Store

from liveshard_core.errors import InvalidInput
from liveshard_core.job import Cause, Deadlines, Result, TrainingSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.spec import ModelSpec

from ..engine import keys
from ..engine.errors import DecisionUnknown, ForgedValue
from ..engine.record import context_logger
from ..engine.sealed import JobStore, Seal
from ..engine.switch import Reconfiguration, SwitchHooks, SwitchResult
from ..engine.vote import Failure, settle
from ..engine.world import World
from . import checkpoint, recovery
from .agreement import NONE, Readiness
from .announcement import AbortAnnounced, Announcement, SwitchAnnounced, announce, announced
from .change import HELD, Change, Pending, Unsettled, max_over_world, state_digest
from .data import job_dataset, tokenizer_of
from .events import Checkpointed, CheckpointFailed, Decided, Switched, Undecided
from .pretrained import load_pretrained
from .recovery import Breakage, BreakReport
from .trainer import Scalars, StepRecord, Trainer, initial_state

log = logging.getLogger(__name__)


class MemberState(Enum):
    """What a member is doing; `Member.state` reads it from what the member holds."""

    STANDING_BY = "standing_by"  # in no world, nothing pending
    JOINING = "joining"  # in no world; prepares a change whose new world it joins
    TRAINING = "training"  # trains in a world (a change may be preparing in the background)
    DONE = "done"  # in a world that trained the job's last step
    BROKEN = "broken"  # its world broke; it keeps its state and waits for a recovery
    RECOVERING = "recovering"  # its world broke and a recovery is pending
    UNDECIDED = "undecided"  # switched, the decision unread (its store died): waits to be told


@dataclass(frozen=True)
class _Checkpoint:
    number: int
    path: str
    at_step: int
    export_to: str = ""


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
        hf: HfModel | None = None,
        pretrained: bool = False,
        seal: Seal | None = None,
    ) -> None:
        """`seal`: the job's (`Seal.of` its credential and name), the same for every member;
        without one, a seal from the job's name alone, which anyone can forge."""
        self.name, self.spec, self.settings = name, spec, settings
        self.device, self.job = device, job
        self._store = store
        self.seal = seal or Seal.of("", job)
        self.deadlines = deadlines or Deadlines()
        self.hooks = hooks or SwitchHooks()
        self.checksums = checksums  # compare whole-state checksum totals around each switch
        self.hf = hf  # the Hugging Face directory the model comes from; checkpoints record it
        self.pretrained = pretrained  # a first world starts from its weights (else fresh)
        tokenizer = tokenizer_of(settings, hf.directory if hf is not None else None)
        self.dataset = job_dataset(settings, tokenizer, spec.config.vocab)
        self.trainer: Trainer | None = None
        self.epoch = -1
        self.pending: Pending | None = None
        self.checkpoint_due: _Checkpoint | None = None
        self.last_loss: float | None = None  # of its last step in the world it trains in
        self.last_exchange_seconds = 0.0  # the last step's (`StepRecord.exchange_seconds`)
        self._agreement: Readiness | None = None  # the last step's readiness, summed
        self.broken: Breakage | None = None
        self._broken_at = 0.0
        self.on_decided: Callable[[Decided], None] | None = None  # see `_decided`
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
    def job_store(self) -> JobStore:
        """The store, with the job's seal on what is written and read there."""
        return JobStore(self.store, self.seal)

    @property
    def state(self) -> MemberState:
        if self.pending is not None and self.pending.undecided is not None:
            return MemberState.UNDECIDED
        # A broken world outranks the rest: its member holds a trainer but may not train.
        if self.broken is not None:
            return MemberState.RECOVERING if self.pending is not None else MemberState.BROKEN
        if self.trainer is None:
            return MemberState.JOINING if self.pending is not None else MemberState.STANDING_BY
        return MemberState.DONE if self.done else MemberState.TRAINING

    @property
    def training(self) -> bool:
        """Whether the member is in a world (also when done, or when the world broke)."""
        return self.trainer is not None

    @property
    def layout(self) -> Layout | None:
        return self.trainer.layout if self.trainer else None

    @property
    def step(self) -> int:
        return self.trainer.scalars.step if self.trainer else -1

    @property
    def done(self) -> bool:
        """Whether its world trained the job's last step (also if that world broke since)."""
        return self.trainer is not None and self.step >= self.settings.steps

    @property
    def speaks(self) -> bool:
        """Whether this member is rank 0 of the world it trains in."""
        return self.trainer is not None and self.trainer.layout.rank_of(self.name) == 0

    def start(self, layout: Layout, epoch: int = 0, scalars: Scalars | None = None) -> None:
        """Join the job's first world with the initial state."""
        world = self._world(layout, epoch)
        rank = layout.rank_of(self.name)
        if self.hf is not None and self.pretrained:
            state = load_pretrained(self.hf, self.spec, layout, rank, self.device)
        else:
            state = initial_state(self.spec, layout, rank, self.settings.seed, self.device)
        self._train(state, world, scalars or Scalars(seed=self.settings.seed))

    def restore(self, layout: Layout, directory: str, epoch: int = 0) -> None:
        """Join a first world with the state and scalars of a checkpoint (written in any
        layout); every member of `layout` calls this."""
        checkpoint.read_metadata(directory, self.spec)  # before any peer is waited for
        world = self._world(layout, epoch)
        try:
            state, scalars = checkpoint.load(
                self.spec, layout, layout.rank_of(self.name), self.device, directory,
                store=self.store, prefix=keys.restore_prefix(epoch, self.seal.tag(epoch)),
                timeout=self.deadlines.prepare,
            )  # fmt: skip
        except checkpoint.CheckpointError:
            world.close()  # it stands by, as before
            raise
        self._train(state, world, scalars)

    def _world(self, layout: Layout, epoch: int) -> World:
        if self.trainer is not None and self.broken is None:
            raise InvalidInput(f"{self.name} already trains in epoch {self.epoch}")
        self.trainer, self.broken = None, None  # a broken world's state: a new world replaces it
        self.settings.micro_batches(layout.dp)  # refuse a layout the global batch cannot fill
        self._set_epoch(epoch)
        return World.build(
            self.store, epoch=epoch, tag=self.seal.tag(epoch), layout=layout, member=self.name,
            device=self.device, timeout=self.deadlines.op,
        )  # fmt: skip

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.log = context_logger(log, job=self.job, epoch=epoch, member=self.name)

    def _train(self, state: Any, world: World, scalars: Scalars) -> None:
        self.last_loss = None  # a member that trained in an earlier world has none here yet
        self.trainer = Trainer(
            state=state, world=world, settings=self.settings, dataset=self.dataset, scalars=scalars
        )

    # ---- training ----

    def train_step(self, stepped: Callable[[StepRecord], None] | None = None) -> StepRecord:
        """Train one step; its last all-reduce also carries this member's readiness for the
        pending change and checkpoint (see `at_boundary`), read just before it: a prepare that
        ended during the step says so in it. `stepped`: see `Trainer.step`."""
        assert self.trainer is not None, f"{self.name} is standing by"
        record = self.trainer.step(lambda: self._readiness().to_vector(), stepped)
        self._agreement = Readiness.from_vector(record.agreement)
        self.last_loss = record.loss
        self.last_exchange_seconds = record.exchange_seconds
        return record

    def _readiness(self) -> Readiness:
        pending, due = self.pending, self.checkpoint_due
        # Read once: the prepare may end meanwhile, and a member must not say both.
        done = pending is not None and pending.future.done()
        failed = done and pending is not None and pending.future.exception() is not None
        return Readiness.of(
            epoch=pending.change.epoch if pending else NONE, prepared=done and not failed,
            failed=failed, at_step=pending.change.at_step if pending else HELD,
            checkpoint=due.number if due else NONE,
        )  # fmt: skip

    def at_boundary(self) -> list[Switched | Undecided | Checkpointed | CheckpointFailed]:
        """Called by every training member after every step: checkpoint and switch if due, as
        the values the step's all-reduce summed say (the same on every member)."""
        trainer, agreed = self.trainer, self._agreement
        assert trainer is not None, f"{self.name} is standing by"
        assert agreed is not None, "a step comes first"
        boundary = time.perf_counter()
        events: list[Switched | Undecided | Checkpointed | CheckpointFailed] = []
        due = self.checkpoint_due
        if due is not None and agreed.same_checkpoint and trainer.scalars.step >= due.at_step:
            events.append(self._checkpoint(due))
        pending = self.pending
        if pending is None or not agreed.same_change:
            return events  # not every member has the same change pending yet
        if pending.change.lost:
            return events  # a recovery: the old world will break, its survivors meet in the store
        epoch = pending.change.epoch
        if agreed.failed:
            failed = int(agreed.failed)
            events.append(self._give_up(f"{failed} member(s) failed to prepare epoch {epoch}"))
            return events
        at = agreed.switch_step()
        if at is None or trainer.scalars.step < at:  # every member's switch step is the same
            return events
        if self.speaks:
            announce(self.job_store, epoch, SwitchAnnounced(trainer.scalars.step, trainer.scalars))
        announcement = self._announced(epoch)
        assert announcement is not None
        if isinstance(announcement, AbortAnnounced):  # first by a member that could not go on
            events.append(self.drop(epoch, announcement.reason))
            return events
        pending.announced = announcement.scalars
        events.append(self._switch(boundary))
        return events

    # ---- checkpoints ----

    def request_checkpoint(
        self, number: int, path: str, at_step: int, export_to: str = ""
    ) -> Checkpointed | CheckpointFailed | None:
        """Save checkpoint `number` to `path` at the first boundary at or after `at_step` at which
        every member of the world has asked for the same number (`export_to`: see
        `Checkpointed`); at once if the world has trained the job's last step (`at_end`). The
        same request again (a step trained again after a recovery asks it again) changes
        nothing."""
        asked = _Checkpoint(number, path, at_step, export_to)
        if self.checkpoint_due == asked:
            return None
        if self.checkpoint_due is not None and self.checkpoint_due.number >= number:
            raise InvalidInput(
                f"checkpoint {number}: checkpoint {self.checkpoint_due.number} is still due"
            )
        if self.done and at_step > self.step:
            raise InvalidInput(
                f"checkpoint {number}: at_step={at_step} is past the job's last step {self.step}"
            )
        self.checkpoint_due = asked
        return self.at_end()

    def at_end(self) -> Checkpointed | CheckpointFailed | None:
        """Once its world has trained the job's last step, no boundary is left to agree at: a
        checkpoint due by then is saved at once. Every member of the world stands at that step
        and does the same, when the job ends or when the request comes, and the save's own
        rendezvous waits for them all."""
        due = self.checkpoint_due
        if not self.done or due is None or due.at_step > self.step:
            return None
        return self._checkpoint(due)

    def checkpoint(self, directory: str, number: int = 0) -> float:
        """Save the job's state now (every member of the world calls this at the same
        boundary); returns the seconds it took. Raises `checkpoint.CheckpointError` on every
        member alike when it could not be saved (see `checkpoint.save`)."""
        trainer = self.trainer
        assert trainer is not None, f"{self.name} is standing by"
        start = time.perf_counter()
        tag = self.seal.tag(self.epoch)
        prefix = keys.checkpoint_prefix(self.epoch, tag, trainer.scalars.step, number)
        checkpoint.save(
            trainer.state, trainer.scalars, self.settings, directory, store=self.store,
            prefix=prefix, timeout=self.deadlines.prepare, hf=self.hf,
        )  # fmt: skip
        return time.perf_counter() - start

    def _checkpoint(self, due: _Checkpoint) -> Checkpointed | CheckpointFailed:
        """Save `due`; a save that failed on any member is reported the same way by all of them,
        and training goes on (the next checkpoint asked for may succeed)."""
        try:
            seconds = self.checkpoint(due.path, due.number)
        except checkpoint.CheckpointError as err:
            self.checkpoint_due = None
            self.log.warning("checkpoint %s at step %s failed: %s", due.number, self.step, err)
            return CheckpointFailed(due.number, self.step, due.path, str(err), self.speaks)
        self.checkpoint_due = None
        return Checkpointed(
            due.number, self.step, due.path, round(seconds, 6), self.speaks, due.export_to
        )

    # ---- reconfiguration ----

    def request(self, change: Change) -> list[Switched]:
        """Begin preparing `change` in the background (a member of either layout calls this).
        A recovery (a change with lost members, or the same layout again asked of a member whose
        world broke: a rebuild, after a partition or a timeout) supersedes a pending change, as
        does any later change asked of a member standing by: the events of those dropped."""
        broken = self.broken
        if broken is not None and not recovers(change, broken=True):
            raise InvalidInput(
                f"{self.name}: the world broke at step {broken.step} ({broken.reason}); only a "
                "recovery (a change with lost members, or the same layout again) can follow"
            )
        superseded = []
        pending = self.pending
        if pending is not None and pending.undecided is not None:
            raise InvalidInput(
                f"{self.name}: epoch {pending.change.epoch} is undecided here (its store failed "
                "before the decision was read); it must be told the decision first"
            )
        if pending is not None:
            by = superseding(change, pending.change.epoch, training=self.trainer is not None,
                             broken=broken is not None, undecided=False)  # fmt: skip
            if by:
                superseded.append(self.drop(pending.change.epoch, f"superseded by {by}"))
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
            lost=change.lost, pods=change.pods, verify=change.verify, job=self.job,
            hooks=dataclasses.replace(self.hooks, before_vote=self._before_vote), seal=self.seal,
        )  # fmt: skip
        self.pending = Pending(
            change, reconfig, reconfig.prepare_in_background(), time.perf_counter()
        )
        self.pending.future.add_done_callback(self._mark_prepared)
        return superseded

    def set_switch_step(self, epoch: int, at_step: int) -> None:
        """Let the pending change `epoch` switch at the first boundary at or after `at_step`."""
        pending = self._pending_epoch(epoch)
        pending.change = dataclasses.replace(pending.change, at_step=at_step)

    def drop(
        self, epoch: int, reason: str = "dropped on request", cause: Cause = Cause.VOTE_NO
    ) -> Switched:
        """Give up the pending change `epoch` before its switch; joining members waiting for its
        announcement are told, and the abort is recorded as the epoch's decision, so that no
        member can commit it. Safe at any moment: a switch needs every member to have it."""
        pending = self._pending_epoch(epoch)
        if pending.undecided is not None:
            return self.decided(epoch, commit=False, why=reason)
        self.pending = None
        pending.reconfig.abort()
        with contextlib.suppress(DecisionUnknown):  # the store is gone: no member can read it
            settle(self.job_store, epoch, Failure(cause, reason))
        if self.speaks or self.broken is not None:
            with contextlib.suppress(RuntimeError):  # torch's: the store is gone, none reads it
                announce(self.job_store, epoch, AbortAnnounced(reason))
        return pending.settled(
            step=self.step, result=Result.ABORTED, cause=cause, reason=reason, pause=0.0,
            report=self.speaks, digests={},
        )  # fmt: skip

    def abandon(self) -> None:
        """Drop a pending change that will never be switched (the job ended first); an undecided
        one waits to be told its decision."""
        if self.pending is not None and self.pending.undecided is None:
            self.drop(self.pending.change.epoch, "the job ended before the switch")

    def _pending_epoch(self, epoch: int) -> Pending:
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
        announced = self.pending.announced if self.pending is not None else None
        if self.trainer is not None and announced is not None:
            mine = self.trainer.scalars
            if mine != announced:
                raise RuntimeError(f"training scalars {mine} differ from the announced {announced}")

    def join(self) -> Switched | Undecided | None:
        """Called repeatedly by a member that is not in the old world, or whose world broke:
        switch with the others once the step is announced; None while it is not (yet). A joining
        member waits at most the prepare deadline after its own prepare ended."""
        pending = self.pending
        assert pending is not None and (self.trainer is None or self.broken is not None)
        if not pending.future.done():
            return None
        start = time.perf_counter()
        failure = pending.failure()
        if failure is not None:
            # The old world's members see the failure too and drop the change; in a recovery,
            # the announcement tells the others.
            self.pending = None
            reason, cause = failure
            if self.broken is not None:
                said = AbortAnnounced(f"{self.name}: {reason}", cause or Cause.VOTE_NO)
                announce(self.job_store, pending.change.epoch, said)
            return pending.settled(
                step=self.step, result=Result.ABORTED, cause=cause, reason=reason, pause=0,
                report=False, digests={},
            )  # fmt: skip
        if self.broken is not None:
            self._meet_survivors(pending)
        announcement = self._announced(pending.change.epoch, wait=False)
        if announcement is None:
            pending.waiting_since = pending.waiting_since or start
            if start - pending.waiting_since < self.deadlines.prepare:
                return None
            announcement = AbortAnnounced(
                f"no switch was announced within {self.deadlines.prepare} s"
            )
        if isinstance(announcement, AbortAnnounced):
            return self.drop(pending.change.epoch, announcement.reason, announcement.cause)
        pending.announced = announcement.scalars
        trainer = self.trainer
        if trainer is not None and trainer.scalars.step < announcement.step:
            self.log.info("one update behind the other survivors: finishing step %s with their "
                          "sums", trainer.scalars.step)  # fmt: skip
            assert announcement.finish is not None, "announced with a survivor behind"
            trainer.finish_step(announcement.finish)
        return self._switch(self._broken_at if self.broken is not None else start)

    # ---- recovery from a broken world ----

    def break_world(self, error: BaseException) -> tuple[Breakage, list[Switched]]:
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
        trainer.world.close()
        pending = self.pending
        if pending is None or pending.change.lost:
            return self.broken, []
        dropped = self.drop(pending.change.epoch, f"the world broke: {reason}", Cause.PEER_FAILED)
        return self.broken, [dropped]

    def _meet_survivors(self, pending: Pending) -> None:
        """Say, once, where this member's world broke; the first survivor announces the recovery
        once all have (`recovery.decide`)."""
        change, trainer = pending.change, self.trainer
        if not pending.published and self.broken is not None and trainer is not None:
            report = BreakReport(trainer.scalars, self.broken, trainer.optimizer.summed)
            recovery.publish(self.job_store, change.epoch, self.name, report)
            pending.published = True
        recovery.decide(
            self.job_store, epoch=change.epoch, member=self.name,
            survivors=[m for m in change.old.members if m not in change.lost],
            broken_at=self._broken_at, deadline=self.deadlines.prepare,
        )  # fmt: skip

    def _announced(self, epoch: int, wait: bool = True) -> Announcement | None:
        """The announcement of `epoch`; one without the job's seal reads as an abort: no member
        acts on what it says, and every member reads the same one, so all give the change up."""
        try:
            return announced(self.job_store, epoch, wait)
        except ForgedValue as err:
            self.log.warning("%s", err)
            return AbortAnnounced(str(err), err.cause)

    def _give_up(self, reason: str) -> Switched:
        """Every old member drops the pending change (some member failed to prepare)."""
        pending = self.pending
        assert pending is not None
        own = pending.future.exception() if pending.future.done() else None
        cause = getattr(own, "cause", None) or Cause.VOTE_NO
        return self.drop(pending.change.epoch, f"{reason}: {own}" if own else reason, cause)

    # ---- the switch ----

    def _switch(self, boundary: float) -> Switched | Undecided:
        pending, trainer = self.pending, self.trainer
        assert pending is not None
        digests: dict[str, str] = {}
        if self.checksums and trainer is not None and self.broken is None:
            digests["before"] = state_digest(trainer.state, trainer.world)
        old_state = trainer.state if trainer is not None else None
        result: SwitchResult = pending.reconfig.switch(old_state)
        if result.undecided:
            pending.undecided = Unsettled(boundary, digests)
            return Undecided(self.name, pending.change.epoch, result.reason)
        return self._settle(pending, result, boundary, digests)

    def decided(self, epoch: int, commit: bool, why: str = "") -> Switched:
        """End the switch of `epoch`, undecided here, as told: commit it (some member read a
        commit) or abort it (none did; `why`)."""
        pending = self._pending_epoch(epoch)
        unsettled = pending.undecided
        if unsettled is None:
            raise InvalidInput(f"{self.name}: epoch {epoch} is pending, not undecided")
        self.log.info("epoch %s: told to %s it", epoch, "commit" if commit else "abort")
        result = pending.reconfig.resolve(commit, why)
        return self._settle(pending, result, unsettled.boundary, unsettled.digests)

    def _settle(
        self, pending: Pending, result: SwitchResult, boundary: float, digests: dict[str, str]
    ) -> Switched:
        """Act on the switch's end: train on in the new world, stand by, or keep the old one."""
        trainer, change = self.trainer, pending.change
        self.pending = None
        if not result.committed:
            # A joining member has nothing to keep: it stands by again.
            if trainer is not None and (self.broken is None or result.state is not trainer.state):
                assert result.state is not None
                trainer.bind(result.state, trainer.world)  # the same state, kept as it was
            self._decided(Decided(self.name, change.epoch, committed=False))
            elapsed = time.perf_counter() - boundary
            pause = elapsed if self.broken is not None else self._max_over_world(elapsed)
            return pending.settled(
                step=self.step, result=Result.ABORTED, cause=result.cause, reason=result.reason,
                pause=pause, report=self.speaks, digests=digests, outcome=result,
            )  # fmt: skip
        self._set_epoch(change.epoch)
        self.broken = None
        if result.state is None or result.world is None:  # this member left
            self.trainer = None
            return pending.settled(
                step=self.step, result=Result.COMMITTED, cause=None, reason=result.reason,
                pause=0.0, report=False, digests=digests, outcome=result,
            )  # fmt: skip
        if trainer is not None:
            trainer.bind(result.state, result.world)
            # A rebuild (every member's world broke, none lost) keeps each member's rows as
            # they were, perhaps one step old; every member shares them again first.
            trainer.reshare = change.old == change.new and not change.lost
        else:
            assert pending.announced is not None
            self._train(result.state, result.world, pending.announced)
        self._decided(Decided(self.name, change.epoch, committed=True))
        if self.checksums:
            try:
                digests["after"] = state_digest(result.state, result.world)
            except RuntimeError as err:  # torch's: a member died after the commit; the next
                # step breaks the world, and this member's account of the commit stands
                digests["after"] = f"unavailable: {err}".split("\n")[0]
        pause = self._max_over_world(time.perf_counter() - boundary)
        return pending.settled(
            step=self.step, result=Result.COMMITTED, cause=None, reason=result.reason, pause=pause,
            report=self.speaks, digests=digests, outcome=result,
        )  # fmt: skip

    def _decided(self, event: Decided) -> None:
        """Say how the switch ended before the collectives that close it (digests, the pause's
        maximum), which wait for every member of the world: one undecided there waits for
        whoever sees this."""
        if self.on_decided is not None:
            self.on_decided(event)

    def _max_over_world(self, seconds: float) -> float:
        return max_over_world(self.trainer.world if self.trainer is not None else None, seconds)


def recovers(change: Change, *, broken: bool) -> bool:
    """Whether `change`, asked of a member whose world broke or not, is a recovery: a change
    with lost members, or the rebuild of a broken world in its own layout (none lost: a
    partition, a timeout). A member whose world broke takes nothing else."""
    return bool(change.lost) or (broken and change.old == change.new)


def superseding(change: Change, pending: int, *, training: bool, broken: bool,
                undecided: bool) -> str:  # fmt: skip
    """What `change` is, named, when it supersedes epoch `pending`, pending at a member that
    trains or not, whose world broke or not, which must be told `pending`'s decision or not;
    "" when it does not. A later recovery (`recovers`) supersedes a pending change. So does any
    later change asked of a member that does not train: one change is in flight at a time, so
    the one it was to join was given up, though it was not told (unless it must be told a
    decision: then it waits for it)."""
    if change.epoch <= pending:
        return ""
    if recovers(change, broken=broken):
        return f"the recovery epoch {change.epoch}"
    if not training and not broken and not undecided:
        return f"epoch {change.epoch}"
    return ""
