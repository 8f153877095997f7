"""What a switch reports: one structured record per switch, and logging with its context.

Every log line of a reconfiguration carries the job, the epoch and the member (`context_logger`),
and every switch ends with one `SwitchRecord` (`switch_record`): its phase timings, bytes and
result, logged as one JSON line, the figure the runtime and the operator report. The record is
that line's shape: its result and cause are the outcome enums' string values. This module must
not import torch at run time (the server's main process logs with it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from liveshard_core.job import Cause, Result
from liveshard_core.layout.layout import Layout

from .modes import Verification

if TYPE_CHECKING:  # the executor's values, only read here: importing it would import torch
    from .executor import Memory, TransferStats


class ContextLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger that prefixes every message with its job, epoch and member, and passes them to
    handlers as record attributes (`record.job`, `record.epoch`, `record.member`)."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(self.extra or {})
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        prefix = " ".join(
            f"{key}={extra[key]}" for key in ("job", "epoch", "member") if key in extra
        )
        return f"[{prefix}] {msg}", kwargs


def context_logger(logger: logging.Logger, *, job: str, epoch: int, member: str) -> ContextLogger:
    return ContextLogger(logger, {"job": job, "epoch": epoch, "member": member})


@dataclass(frozen=True)
class SwitchRecord:
    """One member's account of one switch."""

    job: str
    epoch: int
    member: str
    from_layout: str
    to_layout: str
    result: str  # "committed" or "aborted"
    cause: str | None  # a `Cause` value when aborted
    reason: str
    verified: bool  # whether checksums were compared before the vote
    verification: str  # a `modes.Verification` value: none, moved or state
    memory_mode: str  # a `modes.MemoryMode` value: resident or bounded
    seconds: dict[str, float]  # prepare phases (plan, groups, program, shadow) and the pause's
    # parts (transfer, host_copy in the bounded mode, checksum_new, vote, restore on a bounded
    # abort, pause)
    pause_seconds: float
    local_bytes: int  # kept by this member: copied, or passed on whole (bounded mode)
    sent_bytes: int
    received_bytes: int
    rounds: int  # schedule rounds this member sent or received in
    messages: int  # sends and receives it posted
    stalls: int  # times a round waited for earlier rounds' buffers to make room for it
    shadow_bytes: int  # device memory allocated for the new state
    kept_bytes: int  # old boxes passed on whole to the new state (bounded mode)
    released_bytes: int  # the old state's device storage given back (bounded mode)
    host_bytes: int  # the old state's host copy (bounded mode)
    peak_staging_bytes: int
    peak_extra_bytes: int  # peak device memory above the old state: shadow + staging - released
    budget_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


def switch_record(
    *,
    job: str,
    epoch: int,
    member: str,
    old: Layout,
    new: Layout,
    cause: Cause | None,
    reason: str,
    verification: Verification,
    stats: TransferStats,
    memory: Memory,
    seconds: dict[str, float],
) -> SwitchRecord:
    """The record of one switch: committed when `cause` is None. `seconds` holds prepare's
    phases and the pause's parts, `pause` among them."""
    return SwitchRecord(
        job=job,
        epoch=epoch,
        member=member,
        from_layout=old.describe(),
        to_layout=new.describe(),
        result=(Result.COMMITTED if cause is None else Result.ABORTED).value,
        cause=None if cause is None else cause.value,
        reason=reason,
        verified=verification is not Verification.NONE,
        verification=verification.value,
        memory_mode=memory.mode.value,
        seconds={k: round(v, 6) for k, v in seconds.items()},
        pause_seconds=round(seconds["pause"], 6),
        local_bytes=stats.local_bytes,
        sent_bytes=stats.sent_bytes,
        received_bytes=stats.received_bytes,
        rounds=stats.rounds,
        stalls=stats.stalls,
        messages=stats.messages,
        shadow_bytes=memory.shadow,
        kept_bytes=memory.kept,
        released_bytes=memory.released,
        host_bytes=memory.host,
        peak_staging_bytes=memory.peak_staging,
        peak_extra_bytes=memory.peak_extra,
        budget_bytes=memory.budget,
    )
