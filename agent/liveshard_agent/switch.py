"""The reconfiguration transaction: prepare while training, switch at a step, commit or abort.

1. `prepare` (in a background thread while the old world trains): compute the plan and schedule,
   agree on the plan digest through the store before any byte moves, build the union group and,
   for members of the new layout, the new world.
2. `switch` (at a step boundary, every union member at once): checksum the old state, run the
   schedule into shadow buffers, checksum the shadows, and vote: one all-reduce over the union
   group, with the deadline, of every member's failure flag and checksums.
3. Commit if no member failed and the checksums of every logical tensor match: the shadow becomes
   the state and the old boxes are freed. Abort otherwise: the shadows are freed and the old state
   is left exactly as it was. Every member reaches the same decision from the same all-reduced vote.

Timeouts, short to long (`Timeouts`): one operation < the switch deadline < the prepare deadline.
A deadline that passes aborts; nothing waits longer. Known window: a member that dies *during* the
vote all-reduce can leave members that completed it committed and others aborted; the operator,
which records the committed epoch, reconciles that case.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp, Store

from .layout.layout import Layout
from .plan.plan import Plan, build_plan
from .plan.schedule import Schedule, build_schedule
from .state import ShardedState, checksum_mask
from .transfer import Memory, TransferError, TransferStats, run_schedule
from .vps.spec import ModelSpec
from .world import Group, World, union_group

log = logging.getLogger(__name__)


class PlanMismatch(RuntimeError):
    """Members computed different plans: they disagree about the model, layouts or members."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds; each must be shorter than the next."""

    op: float = 30.0  # creating a group, one operation outside a switch
    switch: float = 120.0  # transfer, checksums and vote
    prepare: float = 300.0  # plan, digest agreement, world building

    def __post_init__(self) -> None:
        if not 0 < self.op <= self.switch <= self.prepare:
            raise ValueError(f"timeouts must satisfy 0 < op <= switch <= prepare, got {self}")


class FaultKind(Enum):
    VOTE_NO = "vote_no"
    EXIT = "exit"  # the process dies without warning
    STALL = "stall"  # the process stops answering for `seconds`


@dataclass(frozen=True)
class Fault:
    """A failure to inject at this member when round `round` starts (for fault-injection tests)."""

    kind: FaultKind
    round: int = 0
    seconds: float = 0.0


@dataclass
class SwitchResult:
    committed: bool
    reason: str
    state: ShardedState | None  # the member's state after the switch (None: it left)
    world: World | None  # the world it trains in after the switch
    stats: TransferStats
    memory: Memory
    seconds: dict[str, float] = field(default_factory=dict)  # the pause: transfer (with local
    # copies and the old state's checksum), checksum_new, vote


class Reconfiguration:
    """One member's side of the move from `old` to `new` in epoch `epoch`."""

    def __init__(
        self,
        spec: ModelSpec,
        old: Layout,
        new: Layout,
        member: str,
        store: Store,
        epoch: int,
        device: torch.device,
        budget: int,
        timeouts: Timeouts | None = None,
        lost: frozenset[str] = frozenset(),
        verify: bool = True,
    ) -> None:
        """`lost` names old members that died with their state: the plan uses surviving copies.
        `verify=False` skips the checksums: the vote then only carries failures, and the bytes
        are trusted to the transport."""
        self.spec, self.old, self.new, self.member, self.lost = spec, old, new, member, lost
        self.verify = verify
        self.store, self.epoch, self.device, self.budget = store, epoch, device, budget
        self.timeouts = timeouts or Timeouts()
        self.seconds: dict[str, float] = {}
        self.plan: Plan | None = None
        self.schedule: Schedule | None = None
        self.union: Group | None = None
        self.world: World | None = None
        self.shadow: ShardedState | None = None  # allocated and touched in prepare

    def prepare_in_background(self) -> Future[None]:
        """Run `prepare` in a thread of its own; the caller keeps training and later waits."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prepare-{self.epoch}")
        future = pool.submit(self.prepare)
        pool.shutdown(wait=False)
        return future

    def prepare(self) -> None:
        # A store client is not safe to share between threads: prepare uses a clone of its own.
        self.store = self.store.clone()
        start = time.perf_counter()
        self.plan = build_plan(self.spec, self.old, self.new, self.lost)
        self.schedule = build_schedule(self.plan, self.budget)
        self.seconds["plan"] = time.perf_counter() - start
        if self.member not in self.plan.members:
            raise ValueError(f"epoch {self.epoch}: {self.member} is in neither layout")
        self._agree_on_digest(self.plan)
        start = time.perf_counter()
        self.union = union_group(
            self.store, self.epoch, self.plan.members, self.member, self.device,
            self.timeouts.switch,
        )  # fmt: skip
        if self.member in self.new.members:
            self.world = World.build(
                self.store, self.epoch, self.new, self.member, self.device, self.timeouts.op
            )
        self.seconds["groups"] = time.perf_counter() - start
        # The new state's storage, first-touched here so that the pause does not pay for it.
        start = time.perf_counter()
        if self.member in self.new.members:
            rank = self.new.members.index(self.member)
            self.shadow = ShardedState.allocate(self.spec, self.new, rank, self.device)
        self.seconds["shadow"] = time.perf_counter() - start

    def _agree_on_digest(self, plan: Plan) -> None:
        """Publish this member's plan digest and compare it with every other member's."""
        prefix = f"liveshard/{self.epoch}/digest/"
        self.store.set(prefix + self.member, plan.digest)
        keys = [prefix + m for m in plan.members]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeouts.prepare))
        except RuntimeError:
            raise PlanMismatch(
                f"epoch {self.epoch}: not every member of {list(plan.members)} published a plan "
                f"digest within {self.timeouts.prepare} s"
            ) from None
        differ = [
            m
            for m, k in zip(plan.members, keys, strict=True)
            if self.store.get(k).decode() != plan.digest
        ]
        if differ:
            raise PlanMismatch(
                f"epoch {self.epoch}: members {differ} computed a different plan than "
                f"{self.member} (digest {plan.digest[:12]}); they disagree about the model, "
                "layouts or members"
            )

    def switch(self, old_state: ShardedState | None, fault: Fault | None = None) -> SwitchResult:
        """Move the state into the new layout; commit or abort everywhere together."""
        assert self.plan is not None and self.schedule is not None and self.union is not None
        deadline = time.monotonic() + self.timeouts.switch
        me = self.plan.members.index(self.member)
        shadow, self.shadow = self.shadow, None
        memory = Memory(self.budget, old=old_state.nbytes if old_state else 0)
        memory.shadow = shadow.nbytes if shadow is not None else 0
        zeros = torch.zeros((len(self.spec.params) * 4, 3), dtype=torch.int64, device=self.device)
        sums = {"old": zeros, "new": zeros}

        def checksum_old() -> None:  # reads the old state only: runs while round 0 is in flight
            if old_state is not None:
                sums["old"] = old_state.checksums()

        seconds: dict[str, float] = {}
        failure, stats = "", TransferStats()
        start = time.perf_counter()
        try:
            stats = run_schedule(
                self.schedule, me, old_state, shadow, self.union, deadline, self.epoch, memory,
                overlap=checksum_old if self.verify else None, on_round=_injector(fault),
            )  # fmt: skip
        except TransferError as err:
            failure = str(err)
        seconds["transfer"] = time.perf_counter() - start
        start = time.perf_counter()
        if shadow is not None and not failure and self.verify:
            sums["new"] = shadow.checksums()
        seconds["checksum_new"] = time.perf_counter() - start
        if fault is not None and fault.kind is FaultKind.VOTE_NO:
            failure = failure or f"epoch {self.epoch}: {self.member} voted no (injected fault)"

        start = time.perf_counter()
        committed, reason = self._vote(failure, sums["old"], sums["new"], deadline)
        seconds["vote"] = time.perf_counter() - start
        if not committed:
            # Operations a failure left pending would each hold the group's teardown for a
            # whole timeout; aborting ends them (and tells peers still waiting) at once.
            self.union.abort()
        self.union = None  # the union group is done either way; dropping it closes it
        if committed:
            if old_state is not None:
                old_state.boxes.clear()
            log.info("epoch %s: %s committed", self.epoch, self.member)
            return SwitchResult(True, reason, shadow, self.world, stats, memory, seconds)
        if shadow is not None:
            shadow.boxes.clear()
        log.warning("epoch %s: %s aborted: %s", self.epoch, self.member, reason)
        self.world = None
        return SwitchResult(False, reason, old_state, None, stats, memory, seconds)

    def _vote(
        self, failure: str, old_sums: torch.Tensor, new_sums: torch.Tensor, deadline: float
    ) -> tuple[bool, str]:
        assert self.union is not None
        vote = torch.cat(
            [
                torch.tensor([1 if failure else 0], device=self.device),
                old_sums.flatten(),
                new_sums.flatten(),
            ]
        )
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        options.timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            self.union.allreduce([vote], options).wait()
        except RuntimeError as err:
            return False, failure or f"epoch {self.epoch}: the vote did not complete: {err}"
        failed = int(vote[0])
        if failed:
            detail = f" ({failure})" if failure else ""
            return False, f"epoch {self.epoch}: {failed} member(s) voted no{detail}"
        n = old_sums.numel()
        old, new = vote[1 : 1 + n].view(-1, 3), vote[1 + n :].view(-1, 3)
        masks = _checksum_masks(self.spec, self.device)
        bad = ((old - new) & masks != 0).any(dim=1).nonzero().flatten().tolist()
        if bad:
            names = [self.spec.tensor_name(self.spec.tensors()[i]) for i in bad[:5]]
            return False, f"epoch {self.epoch}: checksums differ after the transfer for {names}"
        return True, f"epoch {self.epoch}: committed"


def _checksum_masks(spec: ModelSpec, device: torch.device) -> torch.Tensor:
    """Per logical tensor (canonical order), the modulus its checksums are compared in."""
    masks = [checksum_mask(spec.dtype(ref.kind).itemsize) for ref in spec.tensors()]
    return torch.tensor(masks, dtype=torch.int64, device=device).unsqueeze(1)


def _injector(fault: Fault | None):  # type: ignore[no-untyped-def]
    if fault is None or fault.kind is FaultKind.VOTE_NO:
        return None

    def on_round(r: int) -> None:
        if r != fault.round:
            return
        if fault.kind is FaultKind.EXIT:
            os._exit(17)
        time.sleep(fault.seconds)

    return on_round
