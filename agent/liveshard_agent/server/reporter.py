"""The member's loop, seen from the server: its reports and its state, turned into status.

`Reporter` is the loop's `report` callable and the inbox's `on_boundary`; both run on the loop's
thread, the only thread that may read the member. It keeps the status board's `Observed` part and
its events (last switch, last checkpoint saved and failed, the last refusal) current, settles the
tickets of the commands the loop has obeyed, logs what happened and, given `Metrics`, feeds them
every event and the phase. It must not drive the member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from liveshard_core.job import Cause
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.policy.rebalance import CostWindow

from ..engine.record import ContextLogger, context_logger
from ..runtime.events import (
    Broke,
    Checkpointed,
    CheckpointFailed,
    Event,
    Finished,
    Refused,
    Stepped,
    Switched,
    Undecided,
)
from ..runtime.member import Member, MemberState
from .inbox import Ticket
from .metrics import Metrics
from .status import (
    CheckpointSummary,
    CostsView,
    Observed,
    PendingState,
    PendingView,
    Snapshot,
    StatusBoard,
    SwitchSummary,
)

log = logging.getLogger(__name__)


def observe(
    member: Member, before: Observed, layout_of: Callable[[int], Layout | None]
) -> Observed:
    """The member now; `before` supplies what a member that left a world no longer knows (its
    last step and loss). A member that joined a world shows no loss (0) until it trains a step
    there, also when it trained in an earlier one."""
    pending = member.pending
    view = None
    if pending is not None:
        state, reason = PendingState.PREPARING, ""
        if pending.undecided is not None:
            state, reason = PendingState.UNDECIDED, "the decision could not be read"
        elif pending.future.done():
            error = pending.future.exception()
            state = PendingState.FAILED if error else PendingState.PREPARED
            reason = f"{type(error).__name__}: {error}" if error else ""
        view = PendingView(pending.change.epoch, state, pending.change.at_step, reason)
    due = member.checkpoint_due
    # A member that left trains in no world; it shows the world it left to, which names the
    # epoch in effect without it.
    layout = member.layout if member.training else layout_of(member.epoch)
    trainer = member.trainer
    held = trainer.held_bytes() if trainer is not None else (0, 0)  # training, or broken
    return Observed(
        training=member.training, joining=member.state is MemberState.JOINING,
        broken=member.broken is not None,
        done=member.done, epoch=member.epoch,
        step=member.step if member.training else before.step,
        samples=trainer.scalars.samples if trainer is not None else before.samples,
        layout=layout,
        loss=(member.last_loss or 0.0) if member.training else before.loss, pending=view,
        checkpoint_due=due.number if due is not None else None,
        state_bytes=held[0], mirrored_bytes=held[1],
        exchange_seconds=member.last_exchange_seconds if member.training else 0.0,
    )  # fmt: skip


class Reporter:
    def __init__(
        self,
        member: Member,
        board: StatusBoard,
        job: str,
        layout_of: Callable[[int], Layout | None],
        metrics: Metrics | None = None,
        window_steps: int = RebalanceSettings.window_steps,
    ) -> None:
        self.member, self.board, self.job = member, board, job
        self.window = CostWindow(window_steps)  # the costs measured in one layout
        self._measured_in = ""  # that layout
        self.layout_of = layout_of
        self.metrics = metrics
        self._refusal: str | None = None  # of the command being obeyed
        self._last_logged_step = -1

    @property
    def log(self) -> ContextLogger:
        return context_logger(log, job=self.job, epoch=self.member.epoch, member=self.member.name)

    def __call__(self, event: Event) -> None:
        """`run_member`'s report."""
        if self.metrics is not None:
            self.metrics.report(event)
        update: dict[str, Any] = {}
        match event:
            case Stepped(record=record):
                self.log.debug("step %s: loss %.4f", record.step, record.loss)
                update["costs"] = self._costs(event)
            case Switched():
                update["last_switch"] = _switch_summary(event)
                why = "" if event.committed else f" ({_value(event.cause)}: {event.reason})"
                self.log.info(
                    "switch of epoch %s at step %s: %s -> %s %s%s", event.epoch, event.step,
                    event.from_layout, event.to_layout, event.result.value, why,
                )  # fmt: skip
            case Checkpointed():
                exported = event.export_to if event.report and not event.export_error else ""
                update["last_checkpoint"] = CheckpointSummary(
                    event.number, event.step, event.path, event.seconds, exported,
                    event.export_error,
                )  # fmt: skip
                update["failed_checkpoint"] = None
                self.log.info("checkpoint %s saved at step %s to %s", event.number, event.step,
                              event.path)  # fmt: skip
            case CheckpointFailed():
                update["failed_checkpoint"] = CheckpointSummary(
                    event.number, event.step, event.path, 0.0, error=event.reason
                )
                self.log.warning("checkpoint %s at step %s to %s failed: %s", event.number,
                                 event.step, event.path, event.reason)  # fmt: skip
            case Undecided(epoch=epoch, reason=reason):
                update["message"] = f"epoch {epoch} is undecided here: {reason}"
                self.log.warning("%s; waiting to be told the decision", update["message"])
            case Broke(breakage=breakage):
                update["message"] = f"the world broke at step {breakage.step}: {breakage.reason}"
                self.log.warning("%s; waiting for a recovery", update["message"])
            case Finished():
                self.log.info("the job trained its last step (%s)", event.step)
            case Refused():
                message = f"{event.command} refused: {event.message}"
                self._refusal = message
                update["message"] = message
                self.log.warning("%s", message)
        self._refresh(update, ())

    def _costs(self, event: Stepped) -> CostsView | None:
        """The costs measured over the window, in the layout `event` trained in."""
        if event.layout != self._measured_in:
            self.window.clear()
            self._measured_in = event.layout
        if event.record.costs.layers:
            self.window.add(event.record.costs)
        costs = self.window.median()
        return (
            None if costs is None else CostsView.of(costs, len(self.window.seen), event.pp_layers)
        )

    def boundary(self, settled: list[Ticket]) -> None:
        """The inbox's `on_boundary`: the loop is between commands and steps."""
        for ticket in settled:
            ticket.error, self._refusal = self._refusal, None
        self._refresh({}, settled)

    def fail(self, message: str) -> None:
        """The member's loop stopped on an error: the agent can train no more (called while the
        error is handled, so its traceback is logged)."""
        self.log.error("the member's loop failed: %s", message, exc_info=True)
        self._update(lambda s: replace(s, failure=message, message=message))

    def _refresh(self, update: dict[str, Any], settled: list[Ticket] | tuple[()]) -> None:
        done = {t.number for t in settled}
        snapshot = self.board.get()
        observed = observe(self.member, snapshot.observed, self.layout_of)

        def change(s: Snapshot) -> Snapshot:
            claims = tuple(c for c in s.claims if c.ticket not in done)
            return replace(s, observed=observed, claims=claims, **update)

        self._update(change)

    def _update(self, change: Callable[[Snapshot], Snapshot]) -> None:
        """Change the status board, and show the phase it computes to the metrics."""
        snapshot = self.board.update(change)
        if self.metrics is not None:
            self.metrics.set_phase(snapshot.phase)


def _switch_summary(event: Switched) -> SwitchSummary:
    return SwitchSummary(
        epoch=event.epoch, step=event.step, result=event.result, cause=event.cause,
        reason=event.reason, from_layout=event.from_layout, to_layout=event.to_layout,
        pause_seconds=event.pause_seconds, prepare_seconds=event.prepare_seconds,
        network_bytes=event.network_bytes,
    )  # fmt: skip


def _value(cause: Cause | None) -> str | None:
    """A cause as the log spells it (None for a switch aborted without one)."""
    return cause.value if cause is not None else None
