"""A change's announcement: what its members switch with, told through the change's store.

The old world's rank 0 announces the step its world switches at and the training scalars
(`SwitchAnnounced`), so that joining members, which do not train in the old world, switch with
it from the same scalars; a broken world's first survivor announces the recovery the same way
(with the sums that let survivors one update behind finish it). A member that gives a change up
announces an abort (`AbortAnnounced`), so that members waiting for the announcement do not wait
in vain. The first announcement of an epoch stands (a compare-and-set), so every member reads
the same one. Announcements are sealed with the job's credential (`engine.sealed`): one without
the seal is refused (`ForgedValue`), never acted on. This module only writes and reads
announcements; it must not decide them.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from liveshard_core.job import Cause

from ..engine import keys
from ..engine.errors import ForgedValue
from ..engine.sealed import JobStore
from .trainer import Scalars


@dataclass(frozen=True)
class SwitchAnnounced:
    """Switch at `step` with `scalars`; `finish`: the sums of the last update, for survivors of
    a broken world that are one update behind."""

    step: int
    scalars: Scalars
    finish: tuple[float, ...] | None = None


@dataclass(frozen=True)
class AbortAnnounced:
    """The change is given up: every member keeps its world (or, in a recovery, its state)."""

    reason: str
    cause: Cause = Cause.VOTE_NO


Announcement = SwitchAnnounced | AbortAnnounced


def announce(store: JobStore, epoch: int, announcement: Announcement) -> None:
    """Announce a switch or an abort, unless one was announced first for `epoch`."""
    key = keys.announcement(epoch, store.tag(epoch))
    # A first one without the seal stands too; every reader refuses it (`announced`).
    with contextlib.suppress(ForgedValue):
        store.first(key, json.dumps(_encode(announcement)))


def announced(store: JobStore, epoch: int, wait: bool = True) -> Announcement | None:
    """The announcement of `epoch`; without `wait`, None while there is none yet. Waiting lasts
    up to the store's timeout (the store raises after it). `ForgedValue` if the one that stands
    is not sealed."""
    key = keys.announcement(epoch, store.tag(epoch))
    if not wait and not store.check([key]):
        return None
    return _decode(json.loads(store.get(key)))


def _encode(announcement: Announcement) -> dict[str, Any]:
    if isinstance(announcement, AbortAnnounced):
        return {"abort": announcement.reason, "cause": announcement.cause.value}
    content: dict[str, Any] = {
        "step": announcement.step,
        "scalars": announcement.scalars.as_dict(),
    }
    if announcement.finish is not None:
        content["finish"] = list(announcement.finish)
    return content


def _decode(content: dict[str, Any]) -> Announcement:
    if "abort" in content:
        return AbortAnnounced(
            str(content["abort"]), Cause(content.get("cause", Cause.VOTE_NO.value))
        )
    finish = content.get("finish")
    return SwitchAnnounced(
        int(content["step"]),
        Scalars.from_dict(content["scalars"]),
        None if finish is None else tuple(float(v) for v in finish),
    )
