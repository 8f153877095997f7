"""Dry run: the pause a schedule predicts, before any byte moves.

Model: members run the rounds in order, and a round lasts as long as its busiest member needs to
push its bytes through its link, plus a fixed per-round latency (posting the operations and
waiting for the slowest peer):

    pause = sum over rounds r of ( max over members m of bytes(m, r) / bandwidth + latency )

where `bytes(m, r)` is what member m sends plus what it receives in round r (both directions
share the member's link and its copy engine; the schedule budgets the same sum). Local copies are
left out: they overlap the first round. The bandwidth is one member's, in bytes per second.

Members of one pod (its devices, linked by NVLink) may be given a second link (`Links`): a
member's bytes to and from its pod's members cross it at `local_bandwidth`, its other bytes the
network, and its time in a round is the sum of both.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidInput
from ..layout.layout import Layout
from ..vps.spec import ModelSpec
from .matching import Slot
from .plan import build_plan
from .schedule import Schedule, build_schedule

BANDWIDTH = 25e9  # bytes per second of one member's link, unless measured (`liveshard plan`'s)
LATENCY = 1e-3  # seconds added to every round


@dataclass(frozen=True)
class Prediction:
    """What a schedule will cost: time per round and bytes per member."""

    bandwidth: float  # bytes per second of one member's link
    latency: float  # seconds added to every round
    round_seconds: tuple[float, ...]
    send_bytes: dict[Slot, int]  # per slot, over the whole schedule
    recv_bytes: dict[Slot, int]
    peak_buffer_bytes: int  # the most any member holds in flight in one round

    @property
    def pause_seconds(self) -> float:
        return sum(self.round_seconds)

    @property
    def rounds(self) -> int:
        return len(self.round_seconds)


@dataclass(frozen=True)
class Links:
    """A second, faster link inside each pod: `pod_of` names each member's pod (a member it
    does not name shares none)."""

    pod_of: Mapping[str, str]
    local_bandwidth: float  # bytes per second of one member's link to its pod's members


def predict(
    schedule: Schedule, bandwidth: float, latency: float = 1e-3, links: Links | None = None
) -> Prediction:
    """The predicted pause of running `schedule` over links of `bandwidth` bytes per second
    (and, with `links`, its pods' own links)."""
    if not bandwidth > 0:
        raise InvalidInput(f"bandwidth {bandwidth!r} must be a positive number of bytes per second")
    if not latency >= 0:
        raise InvalidInput(f"latency {latency!r} must be a number of seconds >= 0")
    if links is not None and not links.local_bandwidth > 0:
        raise InvalidInput(f"local bandwidth {links.local_bandwidth!r} must be positive")
    sends: dict[Slot, int] = defaultdict(int)
    recvs: dict[Slot, int] = defaultdict(int)
    seconds = []
    peak = 0
    plan = schedule.plan
    local_bandwidth = links.local_bandwidth if links is not None else bandwidth
    for used, inside, (round_sends, round_recvs) in zip(
        schedule.round_bytes(), _local_bytes(schedule, links), _round_directions(schedule),
        strict=True,
    ):  # fmt: skip
        peak = max(peak, max(used.values(), default=0))
        busiest = max((
            (n - inside.get(slot, 0)) / bandwidth + inside.get(slot, 0) / local_bandwidth
            for slot, n in used.items()
        ), default=0.0)  # fmt: skip
        seconds.append(busiest + latency)
        for slot, n in round_sends.items():
            sends[slot] += n
        for slot, n in round_recvs.items():
            recvs[slot] += n
    assert sum(sends.values()) == plan.network_bytes
    return Prediction(bandwidth, latency, tuple(seconds), dict(sends), dict(recvs), peak)


def _local_bytes(schedule: Schedule, links: Links | None) -> list[dict[Slot, int]]:
    """Per round, the bytes each slot sends or receives to or from a member of its own pod."""
    pod_of = links.pod_of if links is not None else {}
    pods = [pod_of.get(m) for m in schedule.plan.members]
    out = []
    for moves in schedule.rounds:
        inside: dict[Slot, int] = defaultdict(int)
        for move in moves:
            for src, dst, n in schedule.move_bytes(move):
                if pods[src] is not None and pods[src] == pods[dst]:
                    inside[src] += n
                    inside[dst] += n
        out.append(dict(inside))
    return out


def _round_directions(schedule: Schedule) -> list[tuple[dict[Slot, int], dict[Slot, int]]]:
    """Bytes each slot sends and receives in each round."""
    out = []
    for moves in schedule.rounds:
        sends: dict[Slot, int] = defaultdict(int)
        recvs: dict[Slot, int] = defaultdict(int)
        for move in moves:
            for src, dst, n in schedule.move_bytes(move):
                sends[src] += n
                recvs[dst] += n
        out.append((dict(sends), dict(recvs)))
    return out


def predicted_pause(
    spec: ModelSpec, old: Layout, new: Layout, budget: int, bandwidth: float = BANDWIDTH,
    latency: float = LATENCY, links: Links | None = None,
) -> float:  # fmt: skip
    """The predicted pause of switching from `old` to `new` with `budget` buffer bytes per
    member: the plan (taking bytes inside pods first, with `links`), cut into rounds, through the
    model above."""
    pods = links.pod_of if links is not None else None
    schedule = build_schedule(build_plan(spec, old, new, pods=pods), budget)
    return predict(schedule, bandwidth, latency, links).pause_seconds
