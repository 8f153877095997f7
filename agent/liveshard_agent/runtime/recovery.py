"""Recovery from a broken world: where each survivor stopped, and what their first survivor
announces from that.

A world breaks when one of its collectives fails (a member died without notice, or timed out);
each member it breaks under keeps its state and says where it stopped (`Breakage`). As the old
world cannot agree on anything any more, the survivors of a recovery (a change naming the dead
members `lost`) meet in the recovery's store instead: each publishes a `BreakReport` (its
scalars, its breakage and the sums of its last update), and the lowest-ranked survivor announces
(`announcement`) the switch at their common step, or an abort when their states differ (some took
the step's update and some did not; an update was cut in half) and only a checkpoint can restore
the job (`recovery_decision`). Reports are sealed with the job's credential (`engine.sealed`): one
without the seal is refused and counts as not published (the survivor's own, written after it,
replaces it), so no process without the credential can change the step or the sums a recovery
goes on from. This module decides and exchanges; the member acts on the result.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from liveshard_core.job import Cause

from ..engine import keys
from ..engine.errors import ForgedValue
from ..engine.sealed import JobStore
from .announcement import AbortAnnounced, Announcement, SwitchAnnounced, announce
from .trainer import Scalars


@dataclass(frozen=True)
class Breakage:
    """Where a member's world broke: the member keeps its state for a recovery."""

    step: int  # the next step to train: the state holds every update before it
    whole: bool  # False: the failure cut an update in half; only a checkpoint restores the job
    reason: str
    unfinished: bool = False  # step `step`'s update can be completed with the others' sums


@dataclass(frozen=True)
class BreakReport:
    """What a survivor tells the recovery: its scalars, where it broke, its last update's sums."""

    scalars: Scalars
    breakage: Breakage
    summed: tuple[float, ...]

    def to_json(self) -> str:
        b = self.breakage
        return json.dumps({
            "scalars": self.scalars.as_dict(), "step": b.step, "whole": b.whole,
            "reason": b.reason, "unfinished": b.unfinished, "summed": list(self.summed),
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str | bytes) -> BreakReport:
        data: dict[str, Any] = json.loads(text)
        breakage = Breakage(
            int(data["step"]), bool(data["whole"]), str(data["reason"]), bool(data["unfinished"])
        )
        summed = tuple(float(v) for v in data["summed"])
        return cls(Scalars.from_dict(data["scalars"]), breakage, summed)


def recovery_decision(reports: dict[str, BreakReport]) -> Announcement:
    """What the first survivor of a broken world announces, from every survivor's report: the
    switch at the survivors' last step, with the values that let those one update behind finish
    it (a peer died inside the update's all-reduce, which completed at some members only), or an
    abort saying why there is no common state."""
    cut = [m for m, r in reports.items() if not r.breakage.whole]
    steps = {m: r.scalars.step for m, r in reports.items()}
    last = max(steps.values())
    ahead = [r for r in reports.values() if r.scalars.step == last]
    behind = [m for m, step in steps.items() if step != last]
    stuck = [m for m in behind if steps[m] != last - 1 or not reports[m].breakage.unfinished]
    if cut:
        why = f"the world broke in the middle of an update at {cut}: their state is half-done"
    elif stuck or (behind and not ahead[0].summed):
        why = f"the survivors stopped at steps {steps}, and {stuck or behind} cannot catch up"
    elif len({r.scalars for r in ahead}) > 1:
        why = f"the survivors at step {last} disagree on the training scalars"
    else:
        return SwitchAnnounced(last, ahead[0].scalars, ahead[0].summed if behind else None)
    return AbortAnnounced(
        f"no common state in memory: {why}; restore from a checkpoint", Cause.NO_COMMON_STATE
    )


def publish(store: JobStore, epoch: int, member: str, report: BreakReport) -> None:
    """Tell the recovery `epoch` where `member`'s world broke."""
    store.put(keys.breakage(epoch, store.tag(epoch), member), report.to_json())


def decide(
    store: JobStore,
    *,
    epoch: int,
    survivors: list[str],
    member: str,
    broken_at: float,
    deadline: float,
) -> None:
    """The lowest-ranked of `survivors` announces the recovery `epoch` once every survivor has
    said where its world broke; it announces an abort when some have not within `deadline`
    seconds of its own world breaking (at `broken_at`, a `time.perf_counter()`). Other members
    do nothing. A report without the job's seal counts as not published."""
    if member != survivors[0]:
        return
    tag = store.tag(epoch)
    published = {m: keys.breakage(epoch, tag, m) for m in survivors}
    complete = store.check(list(published.values()))
    if not complete and time.perf_counter() - broken_at < deadline:
        return
    reports, refused = _read(store, published)
    if len(reports) == len(survivors):
        announce(store, epoch, recovery_decision(reports))
        return
    if time.perf_counter() - broken_at < deadline:
        return  # a forged report: the survivor's own replaces it (`publish` sets, last stands)
    missing = [m for m in survivors if m not in reports]
    why = "".join(f"; {err}" for err in refused)
    announce(store, epoch, AbortAnnounced(
        f"survivors {missing} did not say where their world broke within {deadline} s{why}",
        Cause.DEADLINE_PASSED,
    ))  # fmt: skip


def _read(
    store: JobStore, published: dict[str, str]
) -> tuple[dict[str, BreakReport], list[ForgedValue]]:
    """The reports published so far, and the values refused for want of the job's seal."""
    reports: dict[str, BreakReport] = {}
    refused: list[ForgedValue] = []
    for member, key in published.items():
        if not store.check([key]):
            continue
        try:
            reports[member] = BreakReport.from_json(store.get(key))
        except ForgedValue as err:
            refused.append(err)
    return reports, refused
