"""The reconfiguration transaction: prepare while training, switch at a step, commit or abort.

A `Reconfiguration` is one member's side of one epoch's change, and moves through explicit phases
(`Phase`), checked on every call:

1. CREATED -> PREPARING -> PREPARED (`prepare_in_background`, in a thread while the old world
   trains, bounded by the prepare deadline): refuse an epoch already used on this store, compute
   the member's own part of the plan (`plan.view.member_plan`: its cost follows what the member
   holds and needs, not the number of members), agree on the plan digest through the store before
   any byte moves, build the union group, unite the members' traffic over it (`agreement`) and
   cut the member's rounds from it (`plan.schedule.member_schedule`: the rounds the whole plan's
   schedule gives it), build the new world, lay out the member's program (`program`: the
   schedule's rounds as messages, so the pause runs no planning code) and allocate what the
   memory mode writes into. A prepare that fails or passes its deadline ends in FAILED.
2. PREPARED -> SWITCHING (`switch`, at a step boundary, every union member at once): run the
   program into the shadow, checksumming as the verification asks (`modes.Verification`: the
   moved bytes as they are sent and received, by default), and vote (`vote`): one all-reduce over
   the union group, within the switch deadline, of every member's failure flag and checksums.
3. Each member proposes its view of the vote as the epoch's decision in the store; the first
   recorded stands (`vote.settle`), and every member acts on it. -> COMMITTED if nobody failed and
   every logical tensor's checksums match: the shadow becomes the state, the caller's old state
   object is released (see `state`). -> ABORTED otherwise: the shadow is dropped and the caller
   keeps its old state exactly as it was. A prepared reconfiguration that will not switch is
   `abort`ed.

Memory (`modes.MemoryMode`) is the mode's own business (`executor.SwitchMemory`, chosen once in
`MEMORY_MODES`): RESIDENT (`resident`) allocates the whole shadow in prepare and keeps the old
state as it is; BOUNDED (`offload`) keeps the old state in host memory and fills the shadow as
the old device storage is given back, within the budget plus the member's own growth, and
restores the old state from the host copy on abort.

Deadlines, short to long (`liveshard_core.job.Deadlines`): one operation < the switch deadline <
the prepare deadline. A deadline that passes aborts; nothing waits longer. A member that dies
*during* the vote all-reduce can let it complete at some members only: the recorded decision keeps
them together. When the store's host dies before a member has read the decision, the member acts
alone only on an abort no commit can contradict (`vote.stands_alone`); otherwise it is UNDECIDED:
it keeps its old state and its shadow, both whole, and `resolve` ends the switch as it is told
(whoever tells it commits it when any member trains in the epoch, and aborts it otherwise).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from functools import partial

import torch
from torch.distributed import Store

from liveshard_core.job import Deadlines
from liveshard_core.layout.layout import Layout
from liveshard_core.plan.plan import change_digest
from liveshard_core.plan.schedule import MemberSchedule, member_schedule
from liveshard_core.plan.union import Pods, Union
from liveshard_core.plan.view import MemberPlan, member_plan
from liveshard_core.vps.box import Box
from liveshard_core.vps.spec import ModelSpec, TensorRef

from .agreement import agree_on_digest, agree_on_traffic, claim_epoch
from .backend import Group
from .checksum import Checksums, MovedSums
from .errors import Cause, DecisionUnknown, PhaseError, PrepareTimeout, TransferError
from .executor import Memory, SwitchMemory, SwitchSide, TransferStats, run_program
from .modes import MemoryMode, Verification
from .offload import BoundedMemory
from .program import Program, build_program
from .record import SwitchRecord, context_logger, switch_record
from .resident import ResidentMemory
from .sealed import JobStore, Seal
from .state import ShardedState, region_boxes
from .vote import Failure, decide, settle, stands_alone
from .world import World, close_in_background, union_group

__all__ = [
    "MemoryMode",
    "Phase",
    "Reconfiguration",
    "SwitchHooks",
    "SwitchResult",
    "Verification",
]

log = logging.getLogger(__name__)

# Each memory mode's part of a switch: what it allocates in prepare, the storage at the switch.
MEMORY_MODES: dict[MemoryMode, Callable[[SwitchSide], SwitchMemory]] = {
    MemoryMode.RESIDENT: ResidentMemory,
    MemoryMode.BOUNDED: BoundedMemory,
}


class Phase(Enum):
    CREATED = "created"
    PREPARING = "preparing"
    PREPARED = "prepared"
    SWITCHING = "switching"
    COMMITTED = "committed"
    ABORTED = "aborted"
    FAILED = "failed"  # prepare failed or passed its deadline
    UNDECIDED = "undecided"  # switched, but the decision could not be read: waits for `resolve`


@dataclass(frozen=True)
class SwitchHooks:
    """Calls into the switch at fixed points, for instrumentation and fault-injection tests. A
    hook that raises makes this member vote no, with the exception as its reason."""

    before_prepare: Callable[[], None] | None = None  # prepare starts (in its thread)
    before_round: Callable[[int], None] | None = None  # round r of the schedule starts
    before_vote: Callable[[], None] | None = None  # the transfer and checksums are done
    # The vote's all-reduce is done, the decision not recorded yet; a hook that raises makes
    # this member propose an abort, as if its all-reduce had failed.
    before_decision: Callable[[], None] | None = None


@dataclass
class SwitchResult:
    committed: bool
    cause: Cause | None  # None when committed
    reason: str
    state: ShardedState | None  # the member's state after the switch (None: it left)
    world: World | None  # the world it trains in after the switch
    stats: TransferStats
    memory: Memory
    record: SwitchRecord
    seconds: dict[str, float] = field(default_factory=dict)  # the pause: transfer (with local
    # copies and checksums that overlap it; in the bounded mode also the host copy, also given
    # alone as host_copy), checksum_new (the whole new state's, with Verification.STATE), vote
    undecided: bool = False  # the decision could not be read: `Reconfiguration.resolve` ends it


class Reconfiguration:
    """One member's side of the move from `old` to `new` in epoch `epoch`."""

    def __init__(
        self,
        *,
        spec: ModelSpec,
        old: Layout,
        new: Layout,
        member: str,
        store: Store,
        epoch: int,
        device: torch.device,
        budget: int,
        deadlines: Deadlines | None = None,
        lost: frozenset[str] = frozenset(),
        pods: Pods | None = None,
        verify: bool | Verification = True,
        memory: MemoryMode = MemoryMode.RESIDENT,
        job: str = "",
        hooks: SwitchHooks | None = None,
        seal: Seal | None = None,
    ) -> None:
        """`lost` names old members that died with their state: the plan uses surviving copies.
        `pods` names the pod of members that share one: the plan takes bytes inside pods first.
        `verify` chooses what the vote compares (`Verification`; True is MOVED, False is NONE:
        the vote then only carries failures, and the bytes are trusted to the transport).
        `memory` chooses how old state and shadow share the device (`MemoryMode`). `seal` is the
        job's (`sealed.Seal`), the same for every member; without one, a seal from the job's name
        alone, which anyone can forge."""
        if not isinstance(memory, MemoryMode):
            raise TypeError(f"memory must be a MemoryMode, got {memory!r}")
        self.spec, self.old, self.new, self.member, self.lost = spec, old, new, member, lost
        self.pods = dict(pods or {})
        self.verification = Verification.of(verify)
        self.verify = self.verification is not Verification.NONE
        self.memory_mode, self.job = memory, job
        self.store, self.epoch, self.device, self.budget = store, epoch, device, budget
        self.seal = seal or Seal.of("", job)
        self.deadlines = deadlines or Deadlines()
        self.hooks = hooks or SwitchHooks()
        self.seconds: dict[str, float] = {}
        self.log = context_logger(log, job=job, epoch=epoch, member=member)
        self._phase = Phase.CREATED
        self._lock = threading.Lock()
        self._prepared: Future[None] = Future()  # resolved by prepare_in_background
        # Built by prepare:
        self.members: tuple[str, ...] = ()  # the union, by slot
        self.part: MemberPlan | None = None
        self.schedule: MemberSchedule | None = None
        self.network_bytes = 0  # the whole plan's, added up over the union
        self.union: Group | None = None
        self.world: World | None = None
        self.program: Program | None = None
        self._new_boxes: dict[TensorRef, list[Box]] = {}
        self._memory: SwitchMemory | None = None  # the memory mode's, allocated in prepare
        self._moved: MovedSums | None = None
        self._digest = ""
        self._resolve: Callable[[Failure | None], SwitchResult] | None = None  # while UNDECIDED

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def job_store(self) -> JobStore:
        """The store this reconfiguration meets in (prepare's own client), with the job's seal."""
        return JobStore(self.store, self.seal)

    @property
    def shadow(self) -> ShardedState | None:
        """The new state allocated in prepare (the resident mode's; None in the bounded mode,
        which allocates it box by box at the switch)."""
        memory = self._memory
        return memory.shadow if memory is not None else None

    def _advance(self, expected: tuple[Phase, ...], to: Phase) -> None:
        with self._lock:
            if self._phase not in expected:
                raise PhaseError(
                    f"epoch {self.epoch}: {self.member} cannot go to {to.value} from "
                    f"{self._phase.value} (only from {[p.value for p in expected]})"
                )
            self._phase = to

    # ---- prepare ----

    def prepare_in_background(self) -> Future[None]:
        """Run prepare in a thread of its own; the future fails with `PrepareTimeout` at the
        prepare deadline if prepare has not finished by then, and with prepare's own error if it
        fails sooner. The caller keeps training and checks the future at step boundaries."""
        self._advance((Phase.CREATED,), Phase.PREPARING)
        done: Future[None] = Future()
        done.set_running_or_notify_cancel()
        self._prepared = done

        def finish(error: BaseException | None) -> None:
            with self._lock:
                if self._phase is not Phase.PREPARING:
                    return  # the deadline came first; what prepare built is dropped below
                self._phase = Phase.FAILED if error else Phase.PREPARED
            if error is None:
                done.set_result(None)
            else:
                self.log.warning("prepare failed: %s", error)
                done.set_exception(error)

        expired = PrepareTimeout(
            f"epoch {self.epoch}: prepare passed its {self.deadlines.prepare} s deadline"
        )
        timer = threading.Timer(self.deadlines.prepare, finish, args=(expired,))
        timer.daemon = True

        def run() -> None:
            error: BaseException | None = None
            try:
                self._prepare()
            except BaseException as err:
                error = err
            # No callback links the future, the timer and this object in a cycle: a finished
            # reconfiguration is freed (and its groups' threads with it) as soon as it is dropped.
            timer.cancel()
            finish(error)
            if self._phase in (Phase.FAILED, Phase.ABORTED):  # late: drop what it built
                self._release_prepared()

        timer.start()
        threading.Thread(target=run, name=f"prepare-{self.epoch}", daemon=True).start()
        return done

    def prepare(self) -> None:
        """Prepare in the calling thread's stead and wait for it (bounded by the deadline)."""
        self.prepare_in_background().result()

    def _prepare(self) -> None:
        # A store client is not safe to share between threads: prepare uses a clone of its own.
        self.store = self.store.clone()
        if self.hooks.before_prepare is not None:
            self.hooks.before_prepare()
        claim_epoch(self.job_store, self.epoch, self.member)
        start = time.perf_counter()
        union = Union(self.old, self.new, self.lost, self.pods)
        self.members = union.members
        # Raises if the member takes no part.
        part = member_plan(self.spec, self.old, self.new, self.member, self.lost, union)
        self.part = part
        self.seconds["plan"] = time.perf_counter() - start
        self._digest = change_digest(self.spec, self.old, self.new, self.lost, self.pods)
        agree_on_digest(
            self.job_store, epoch=self.epoch, member=self.member, members=self.members,
            digest=self._digest, budget=self.budget, verification=self.verification,
            timeout=self.deadlines.prepare,
        )  # fmt: skip
        start = time.perf_counter()
        tag = self.seal.tag(self.epoch)
        self.union = union_group(
            self.store, epoch=self.epoch, tag=tag, members=self.members, member=self.member,
            device=self.device, timeout=self.deadlines.switch,
        )  # fmt: skip
        deadline = time.monotonic() + self.deadlines.prepare
        traffic, self.network_bytes = agree_on_traffic(self.union, part, deadline, self.device)
        self.schedule = member_schedule(part, traffic, self.budget)
        if self.member in self.new.ranks:
            self.world = World.build(
                self.store, epoch=self.epoch, tag=tag, layout=self.new, member=self.member,
                device=self.device, timeout=self.deadlines.op,
            )  # fmt: skip
        self.seconds["groups"] = time.perf_counter() - start
        side = SwitchSide(
            spec=self.spec, old=self.old, new=self.new, old_rank=self._old_rank(),
            new_rank=self._new_rank(), device=self.device, epoch=self.epoch, member=self.member,
        )  # fmt: skip
        memory = MEMORY_MODES[self.memory_mode](side)
        start = time.perf_counter()
        self.program = self._lay_out(self.schedule, memory.sends_need_buffers)
        self.seconds["program"] = time.perf_counter() - start
        # Memory the pause writes into, first-touched here so that the pause does not pay for
        # page faults: the whole shadow (resident), or the old state's host copy (bounded).
        start = time.perf_counter()
        memory.prepare(self.program, self._new_boxes)
        self._memory = memory
        self.seconds["shadow"] = time.perf_counter() - start
        self.log.info(
            "prepared: plan %s, %s rounds, %s of them with messages here, %s memory, "
            "verification %s",
            self._digest[:12], len(self.schedule.rounds), self.program.active_rounds,
            self.memory_mode.value, self.verification.value,
        )  # fmt: skip

    def _old_rank(self) -> int | None:
        if self.member in self.old.ranks and self.member not in self.lost:
            return self.old.rank_of(self.member)
        return None

    def _new_rank(self) -> int | None:
        return self.new.rank_of(self.member) if self.member in self.new.ranks else None

    def _lay_out(self, schedule: MemberSchedule, sends_need_buffers: bool) -> Program:
        """This member's program, and what it needs to check the moved bytes."""
        old_rank, new_rank = self._old_rank(), self._new_rank()
        old_boxes = {} if old_rank is None else region_boxes(self.spec, self.old, old_rank)
        self._new_boxes = {} if new_rank is None else region_boxes(self.spec, self.new, new_rank)
        program = build_program(
            schedule, schedule.part.slot, old_boxes=old_boxes, new_boxes=self._new_boxes,
            sends_need_buffers=sends_need_buffers,
        )  # fmt: skip
        if self.verification is Verification.MOVED:
            self._moved = MovedSums(program, len(self.members), self.device)
        return program

    def abort(self) -> None:
        """Give up a reconfiguration before its switch, also while it is still preparing (its
        future then fails with `PhaseError`, and what prepare builds is dropped when it ends)."""
        with self._lock:
            preparing = self._phase is Phase.PREPARING
        self._advance((Phase.PREPARING, Phase.PREPARED, Phase.FAILED), Phase.ABORTED)
        if preparing and not self._prepared.done():
            self._prepared.set_exception(
                PhaseError(f"epoch {self.epoch}: aborted by {self.member} while preparing")
            )
        self._release_prepared()

    def _release_prepared(self) -> None:
        with self._lock:
            union, memory = self.union, self._memory
            self.union, self.world, self._memory = None, None, None
        if union is not None:
            union.abort()
        if memory is not None:
            memory.release()

    # ---- switch ----

    def switch(self, old_state: ShardedState | None) -> SwitchResult:
        """Move the state into the new layout; commit or abort everywhere together."""
        self._advance((Phase.PREPARED,), Phase.SWITCHING)
        assert self.program is not None and self.union is not None
        begin = time.perf_counter()
        deadline = time.monotonic() + self.deadlines.switch
        mode, self._memory = self._memory, None
        assert mode is not None
        memory = Memory(self.budget, self.memory_mode, old=old_state.nbytes if old_state else 0)
        sums = {
            "old": Checksums.zeros(self.spec, self.device),
            "new": Checksums.zeros(self.spec, self.device),
        }
        whole_state = self.verification is Verification.STATE
        seconds: dict[str, float] = {}
        failure: Failure | None = None
        stats = TransferStats()
        shadow: ShardedState | None = None
        read_old: Callable[[], None] | None = None
        if whole_state and old_state is not None:

            def read_old() -> None:
                sums["old"] = Checksums.of_state(old_state)

        start = time.perf_counter()
        try:
            storage, overlap = mode.storage(old_state, memory, seconds, read_old)
            stats = run_program(
                self.program, storage=storage, group=self.union, device=self.device,
                members=self.members, deadline=deadline, epoch=self.epoch, memory=memory,
                sums=self._moved, overlap=overlap, before_round=self.hooks.before_round,
            )  # fmt: skip
        except TransferError as err:
            # The union is broken: abort it at once, so that peers waiting on this member fail
            # now (naming it) instead of at the deadline. Its vote cannot complete either.
            failure = Failure(err.cause, str(err))
            self.union.abort()
        except Exception as err:  # a hook, or a fault of this member's own: it votes no
            failure = Failure(Cause.VOTE_NO, f"epoch {self.epoch}: {self.member} failed: {err!r}")
        stats.local_bytes = sum(c.nbytes for c in self.program.local)
        seconds["transfer"] = time.perf_counter() - start
        if failure is None:
            shadow = mode.new_state()
        start = time.perf_counter()
        if shadow is not None and failure is None and whole_state:
            sums["new"] = Checksums.of_state(shadow)
        seconds["checksum_new"] = time.perf_counter() - start
        if failure is None and self.hooks.before_vote is not None:
            try:
                self.hooks.before_vote()
            except Exception as err:
                failure = Failure(
                    Cause.VOTE_NO, f"epoch {self.epoch}: {self.member} voted no: {err}"
                )

        start = time.perf_counter()
        broken = failure is not None and failure.cause in (Cause.PEER_FAILED, Cause.DEADLINE_PASSED)
        outcome = failure
        if not broken:
            outcome = decide(
                self.union, failure=failure, verification=self.verification,
                state_sums=(sums["old"], sums["new"]), moved=self._moved, spec=self.spec,
                members=self.members, epoch=self.epoch, deadline=deadline, device=self.device,
            )  # fmt: skip
            if self.hooks.before_decision is not None:
                try:
                    self.hooks.before_decision()
                except Exception as err:
                    outcome = outcome or Failure(
                        Cause.VOTE_INCOMPLETE, f"epoch {self.epoch}: {self.member}: {err}"
                    )
        finish = partial(
            self._finish, broken=broken, old_state=old_state, shadow=shadow, mode=mode,
            stats=stats, memory=memory, seconds=seconds, begin=begin, vote_began=start,
        )  # fmt: skip
        try:
            recorded = settle(self.job_store, self.epoch, outcome)
        except DecisionUnknown as err:
            if not stands_alone(failure is not None, outcome):
                seconds["vote"] = time.perf_counter() - start
                seconds["pause"] = time.perf_counter() - begin  # so far
                return self._undecided(finish, str(err), stats, memory, seconds)
            recorded = outcome
        # An abort keeps this member's own reason where it has one: the most precise.
        outcome = None if recorded is None else outcome or recorded
        if outcome is None and failure is not None:  # a commit needs every member's yes
            raise AssertionError(f"epoch {self.epoch}: commit recorded over {self.member}'s no")
        return finish(outcome)

    def _undecided(
        self,
        finish: Callable[[Failure | None], SwitchResult],
        why: str,
        stats: TransferStats,
        memory: Memory,
        seconds: dict[str, float],
    ) -> SwitchResult:
        """The decision cannot be read and this member's view cannot stand alone: keep the old
        state and the shadow, both whole, until `resolve` says which the epoch's decision was."""
        self._phase = Phase.UNDECIDED
        self._resolve = finish
        self._close_union(abort=False)
        self.log.warning("undecided: %s; waiting to be told the decision", why)
        record = switch_record(
            job=self.job, epoch=self.epoch, member=self.member, old=self.old, new=self.new,
            cause=Cause.VOTE_INCOMPLETE, reason=why, verification=self.verification,
            stats=stats, memory=memory, seconds={**self.seconds, **seconds},
        )  # fmt: skip
        return SwitchResult(
            False, Cause.VOTE_INCOMPLETE, why, None, None, stats, memory, record, seconds,
            undecided=True,
        )  # fmt: skip

    def _close_union(self, abort: bool) -> None:
        """The union group is done after the vote: it closes in the background, off the pause
        (aborted first when `abort`)."""
        union, self.union = self.union, None
        if union is None:
            return
        if abort:
            union.abort()
        close_in_background([union])

    def resolve(self, commit: bool, why: str = "") -> SwitchResult:
        """Act on the decision an undecided member is told (`commit`, or abort for `why`): the
        same end as a switch that read it from the store."""
        self._advance((Phase.UNDECIDED,), Phase.SWITCHING)
        finish, self._resolve = self._resolve, None
        assert finish is not None
        told = None if commit else Failure(
            Cause.VOTE_INCOMPLETE, f"epoch {self.epoch}: aborted as told ({why or 'no reason'})"
        )  # fmt: skip
        return finish(told)

    def _finish(
        self,
        outcome: Failure | None,
        *,
        broken: bool,
        old_state: ShardedState | None,
        shadow: ShardedState | None,
        mode: SwitchMemory,
        stats: TransferStats,
        memory: Memory,
        seconds: dict[str, float],
        begin: float,
        vote_began: float,
    ) -> SwitchResult:
        """Commit (`outcome` None) or abort, as decided."""
        seconds["vote"] = time.perf_counter() - vote_began
        # Operations a failure left pending would each hold the group's teardown for a whole
        # timeout; aborting ends them (and tells peers still waiting) at once.
        self._close_union(abort=outcome is not None and not broken)
        if outcome is None:
            self._phase = Phase.COMMITTED
            if old_state is not None:
                old_state.release()
            state, world = shadow, self.world
        else:
            self._phase = Phase.ABORTED
            if shadow is not None:
                shadow.release()
            mode.abort(seconds)  # the bounded mode's old storage comes back from the host copy
            state, world, self.world = old_state, None, None
        seconds["pause"] = time.perf_counter() - begin
        record = switch_record(
            job=self.job, epoch=self.epoch, member=self.member, old=self.old, new=self.new,
            cause=None if outcome is None else outcome.cause,
            reason=f"epoch {self.epoch}: committed" if outcome is None else outcome.reason,
            verification=self.verification, stats=stats, memory=memory,
            seconds={**self.seconds, **seconds},
        )  # fmt: skip
        (self.log.info if outcome is None else self.log.warning)("switch %s", record.to_json())
        cause, reason = (
            (None, record.reason) if outcome is None else (outcome.cause, outcome.reason)
        )
        return SwitchResult(
            outcome is None, cause, reason, state, world, stats, memory, record, seconds
        )
