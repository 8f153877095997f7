"""The agent's status: one immutable `Snapshot` on a `StatusBoard` that GetStatus reads and
WatchStatus follows.

A snapshot joins three sources: what the member's loop last showed (`Observed`, refreshed on the
loop's thread between commands and steps), the commands the service accepted and the loop has not
finished yet (`Claim`s, so a status read right after a Prepare shows it pending), and the events
the loop reported (last switch, last checkpoint saved and the last that failed, the last
refusal). The phase and the pending
reconfiguration are computed from them, never stored twice. This module must not drive the member.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

from liveshard.layouts import to_message
from liveshard.v1 import agent_pb2 as pb
from liveshard_core.job import Cause, Result
from liveshard_core.layout.layout import Layout
from liveshard_core.policy.rebalance import StepCosts, imbalance, stage_times


class Phase(Enum):
    STARTING = pb.AgentStatus.STARTING
    STANDBY = pb.AgentStatus.STANDBY
    JOINING = pb.AgentStatus.JOINING
    TRAINING = pb.AgentStatus.TRAINING
    DONE = pb.AgentStatus.DONE
    FAILED = pb.AgentStatus.FAILED
    BROKEN = pb.AgentStatus.BROKEN


class PendingState(Enum):
    PREPARING = pb.Pending.PREPARING
    PREPARED = pb.Pending.PREPARED
    FAILED = pb.Pending.FAILED
    UNDECIDED = pb.Pending.UNDECIDED


@dataclass(frozen=True)
class PendingView:
    epoch: int
    state: PendingState
    at_step: int  # -1: held
    reason: str = ""


@dataclass(frozen=True)
class Observed:
    """The member as its loop last showed it."""

    training: bool = False
    joining: bool = False
    broken: bool = False  # its world broke; it waits for a recovery
    done: bool = False
    epoch: int = -1  # the latest epoch it knows in effect (-1: none yet)
    step: int = 0  # the next step to train (kept after it leaves a world)
    samples: int = 0  # the data cursor: samples the job has consumed (kept likewise)
    layout: Layout | None = None  # of that epoch
    loss: float = 0.0
    pending: PendingView | None = None
    checkpoint_due: int | None = None  # the number of a checkpoint asked for and not yet saved
    state_bytes: int = 0  # the training state it holds (0: none, standing by)
    mirrored_bytes: int = 0  # of it, the copies it holds for others (`Layout.mirror`)
    exchange_seconds: float = 0.0  # its last step's gradient exchange with its peers


class ClaimKind(Enum):
    START = "start"  # the job's first world
    CHANGE = "change"  # a reconfiguration
    SWITCH = "switch"
    DROP = "drop"
    CHECKPOINT = "checkpoint"
    STOP = "stop"


@dataclass(frozen=True)
class Claim:
    """A command the service accepted that the member's loop has not finished yet."""

    ticket: int
    kind: ClaimKind
    number: int  # the epoch, or a checkpoint's number
    at_step: int = 0
    layout: Layout | None = None  # the layout a START or CHANGE leads to


@dataclass(frozen=True)
class SwitchSummary:
    epoch: int
    step: int
    result: Result
    cause: Cause | None  # None when committed
    reason: str
    from_layout: str
    to_layout: str
    pause_seconds: float
    prepare_seconds: float
    network_bytes: int


@dataclass(frozen=True)
class CheckpointSummary:
    number: int
    step: int
    path: str
    seconds: float
    exported_to: str = ""
    export_error: str = ""
    error: str = ""  # non-empty: it could not be saved, for this reason


@dataclass(frozen=True)
class CostsView:
    """The job's measured costs: the window's medians (`policy.rebalance`), over `steps` steps of
    the layout in effect, with its stages' seconds and their imbalance."""

    costs: StepCosts
    steps: int
    stage_seconds: tuple[float, ...]
    imbalance: float

    @classmethod
    def of(cls, costs: StepCosts, steps: int, pp_layers: tuple[int, ...]) -> CostsView:
        return cls(costs, steps, stage_times(costs, pp_layers), imbalance(costs, pp_layers))

    def to_proto(self) -> pb.Costs:
        return pb.Costs(
            layer_seconds=self.costs.layers, first_seconds=self.costs.first,
            last_seconds=self.costs.last, steps=self.steps, imbalance=self.imbalance,
            stage_seconds=self.stage_seconds,
        )  # fmt: skip


@dataclass(frozen=True)
class Snapshot:
    member: str
    steps: int  # the job's last step + 1
    ready: bool = False
    failure: str = ""  # why the member's loop stopped; non-empty: FAILED
    terminating: bool = False
    observed: Observed = field(default_factory=Observed)
    claims: tuple[Claim, ...] = ()
    last_switch: SwitchSummary | None = None
    last_checkpoint: CheckpointSummary | None = None  # the last saved
    failed_checkpoint: CheckpointSummary | None = None  # the last asked for, when it failed
    message: str = ""  # the last refused command or failure, for people
    costs: CostsView | None = None  # the job's measured costs, once a step was measured
    serving: str = ""  # the serving certificate's fingerprint (`certs`); "" in plaintext

    def claimed(self, *kinds: ClaimKind) -> list[Claim]:
        return [c for c in self.claims if c.kind in kinds]

    @property
    def phase(self) -> Phase:
        if not self.ready:
            return Phase.STARTING
        if self.failure:
            return Phase.FAILED
        if self.observed.done:
            return Phase.DONE
        if self.observed.broken:
            return Phase.BROKEN
        if self.observed.training:
            return Phase.TRAINING
        if self.observed.joining or self.claimed(ClaimKind.START, ClaimKind.CHANGE):
            return Phase.JOINING
        return Phase.STANDBY

    @property
    def pending(self) -> PendingView | None:
        """The reconfiguration pending here: the member's, or one accepted and not yet taken."""
        pending = self.observed.pending
        if pending is None:
            for claim in self.claimed(ClaimKind.START, ClaimKind.CHANGE):
                pending = PendingView(claim.number, PendingState.PREPARING, claim.at_step)
        if pending is not None:
            for claim in self.claimed(ClaimKind.SWITCH):
                if claim.number == pending.epoch:
                    pending = replace(pending, at_step=claim.at_step)
        return pending

    @property
    def checkpoint_due(self) -> int | None:
        due = [c.number for c in self.claimed(ClaimKind.CHECKPOINT)]
        return max(due) if due else self.observed.checkpoint_due

    def to_proto(self, layout: bool = True) -> pb.AgentStatus:
        """The status as the API sends it; without the world's layout unless `layout`."""
        seen = self.observed
        status = pb.AgentStatus(
            member=self.member, phase=self.phase.value, ready=self.ready, epoch=seen.epoch,
            step=seen.step, samples=seen.samples, loss=seen.loss, message=self.message,
            terminating=self.terminating, steps=self.steps, serving_certificate=self.serving,
            state_bytes=seen.state_bytes, mirrored_bytes=seen.mirrored_bytes,
            exchange_seconds=seen.exchange_seconds,
        )  # fmt: skip
        if layout and seen.layout is not None:
            status.layout.CopyFrom(to_message(seen.layout))
        pending = self.pending
        if pending is not None:
            status.pending.CopyFrom(
                pb.Pending(
                    epoch=pending.epoch, state=pending.state.value, at_step=pending.at_step,
                    reason=pending.reason,
                    dropping=any(c.number == pending.epoch for c in self.claimed(ClaimKind.DROP)),
                )
            )  # fmt: skip
        if self.last_switch is not None:
            s = self.last_switch
            cause = s.cause.name if s.cause else "CAUSE_UNSPECIFIED"
            status.last_switch.CopyFrom(
                pb.SwitchSummary(
                    epoch=s.epoch, step=s.step, reason=s.reason,
                    result=pb.SwitchSummary.Result.Value(s.result.name),
                    cause=pb.SwitchSummary.Cause.Value(cause),
                    to=s.to_layout, pause_seconds=s.pause_seconds,
                    prepare_seconds=s.prepare_seconds, network_bytes=s.network_bytes,
                    **{"from": s.from_layout},
                )
            )  # fmt: skip
        if self.last_checkpoint is not None:
            status.last_checkpoint.CopyFrom(pb.CheckpointSummary(**asdict(self.last_checkpoint)))
        if self.failed_checkpoint is not None:
            failed = pb.CheckpointSummary(**asdict(self.failed_checkpoint))
            status.failed_checkpoint.CopyFrom(failed)
        if self.costs is not None:
            status.costs.CopyFrom(self.costs.to_proto())
        return status


class StatusBoard:
    """The current snapshot and a version that rises with every change, for watchers."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._version = 0
        self._closed = False
        self._changed = threading.Condition()

    def get(self) -> Snapshot:
        with self._changed:
            return self._snapshot

    def update(self, change: Callable[[Snapshot], Snapshot]) -> Snapshot:
        """Apply `change` atomically; watchers wake only when the snapshot differs."""
        with self._changed:
            new = change(self._snapshot)
            if new != self._snapshot:
                self._snapshot = new
                self._version += 1
                self._changed.notify_all()
            return new

    def wait_newer(self, version: int, timeout: float) -> tuple[int, Snapshot]:
        """The snapshot once its version is past `version`, or as it is after `timeout` s."""
        with self._changed:
            self._changed.wait_for(lambda: self._version > version or self._closed, timeout)
            return self._version, self._snapshot

    def close(self) -> None:
        """End every watch (the agent is going away)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        with self._changed:
            return self._closed
