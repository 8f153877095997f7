"""The job's checkpoints as its status keeps them: the last one saved (`status.lastCheckpoint`),
which outlives the agents that reported it, so that a restore after every agent died still knows
where to start from; and the last one that failed (`status.checkpointFailure`), while no later one
was saved: none of a later step, and none first seen after the failure (after a fall back to an
older checkpoint, the job saves steps before the failed one again).

Each pass takes the newest of what its status holds and what the agents now report: the one of
the latest step, then of the highest number (a suspension takes the next number, which a periodic
checkpoint of a later step takes again after the resume: the numbers follow the step); `time` is
when the operator first saw it. A failed
checkpoint is not asked again: the next one is, at the next period; a suspension's, after
RETRY_SECONDS (`decide`).

Pure: the status and the agents' reports are given, and so is the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .conditions import seconds, stamp
from .observation import Job, Observation

RETRY_SECONDS = 60.0  # a suspension's checkpoint that failed is asked again this much later


@dataclass(frozen=True)
class Saved:
    """Checkpoint `number`, of step `step`, saved whole at `path` (`status.lastCheckpoint`)."""

    number: int
    path: str
    step: int
    time: str  # when the operator first saw it saved

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "path": self.path, "step": self.step, "time": self.time}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Saved:
        return cls(int(data["number"]), str(data["path"]), int(data["step"]), str(data["time"]))


@dataclass(frozen=True)
class Failed:
    """Checkpoint `number` at step `step` to `path` could not be saved (`status.checkpointFailure`,
    while no later checkpoint was): `reason` as the agents gave it."""

    number: int
    path: str
    step: int
    reason: str
    time: str  # when the operator first saw it fail

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "path": self.path, "step": self.step,
                "reason": self.reason, "time": self.time}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failed:
        return cls(int(data["number"]), str(data["path"]), int(data["step"]),
                   str(data["reason"]), str(data["time"]))  # fmt: skip

    @property
    def seconds(self) -> float:
        """`time` in seconds since the epoch (0 if it cannot be read: long ago)."""
        return seconds(self.time, 0.0)

    def describe(self) -> str:
        return f"checkpoint {self.number} of step {self.step} to {self.path} failed: {self.reason}"


class _Numbered(Protocol):
    @property
    def number(self) -> int: ...
    @property
    def step(self) -> int: ...


def _newer(one: _Numbered, other: _Numbered) -> bool:
    """Whether checkpoint `one` is newer than `other`: of a later step, or of the same step and
    a higher number."""
    return (int(one.step), int(one.number)) > (int(other.step), int(other.number))


def last_saved(job: Job, seen: Observation, now: float) -> Saved | None:
    """The newest checkpoint saved: the status's, or a newer one an agent reports."""
    kept = job.status.get("lastCheckpoint")
    best = Saved.from_dict(kept) if kept else None
    for pod in seen.pods.values():
        saved = pod.agent.last_checkpoint if pod.agent is not None else None
        if saved is not None and saved.path and (best is None or _newer(saved, best)):
            best = Saved(int(saved.number), saved.path, int(saved.step), stamp(now))
    return best


def last_failed(job: Job, seen: Observation, now: float) -> Failed | None:
    """The newest checkpoint that failed, when no later one was saved (of a later step, or first
    seen after it)."""
    kept = job.status.get("checkpointFailure")
    best = Failed.from_dict(kept) if kept else None
    for pod in seen.pods.values():
        failed = pod.agent.failed_checkpoint if pod.agent is not None else None
        if failed is not None and failed.error and (best is None or _newer(failed, best)):
            best = Failed(int(failed.number), failed.path, int(failed.step), failed.error,
                          stamp(now))  # fmt: skip
    saved = last_saved(job, seen, now)
    if best is None:
        return None
    if saved is not None and (not _newer(best, saved) or seconds(saved.time, 0.0) > best.seconds):
        return None
    return best


def newly_failed(job: Job, seen: Observation, now: float) -> Failed | None:
    """A failure the status does not hold yet: the pass that sees it says so once."""
    failed = last_failed(job, seen, now)
    kept = job.status.get("checkpointFailure")
    if failed is None or (kept and not _newer(failed, Failed.from_dict(kept))):
        return None
    return failed


def status(job: Job, seen: Observation, now: float) -> dict[str, Any]:
    """`lastCheckpoint` and `checkpointFailure` for the status patch (None removes a failure
    that a later checkpoint made good)."""
    saved, failed = last_saved(job, seen, now), last_failed(job, seen, now)
    out: dict[str, Any] = {}
    if saved is not None:
        out["lastCheckpoint"] = saved.to_dict()
    if failed is not None:
        out["checkpointFailure"] = failed.to_dict()
    elif job.status.get("checkpointFailure"):
        out["checkpointFailure"] = None
    return out
