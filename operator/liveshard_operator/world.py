"""The operator's record of a job, as kept in its status (`status.reconfiguration`): the world in
effect, the reconfiguration in flight, and what the next pass must remember (the epochs used, the
aborts in a row and their backoff, a restore owed, members silent since when, the last checkpoint
asked for, the worker pods that failed to start and when the next may be created), so that a
restarted operator knows all of it. What live rebalancing remembers (`Rebalancing`) is kept beside
it, in `status.rebalance` and `status.released`.

Values only: `Record.from_status` reads what a pass finds in status (`Record.from_dict` its
`status.reconfiguration`), `Record.to_dict` is what the pass writes back there (a merge patch:
every field, None for what is no longer there) and `Rebalancing.to_status` the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from liveshard_core.layout.layout import Degrees, Layout
from liveshard_core.vps.spec import ModelSpec


@dataclass(frozen=True)
class World:
    """The layout in effect (or to come): its degrees and its members in rank order."""

    epoch: int
    degrees: Degrees  # its pipeline partition always set
    members: tuple[str, ...]

    @classmethod
    def of(cls, epoch: int, layout: Layout) -> World:
        return cls(epoch, layout.degrees, layout.members)

    def layout(self, spec: ModelSpec) -> Layout:
        return self.degrees.layout(spec, self.members)

    def describe(self) -> str:
        return self.degrees.describe()

    def to_dict(self) -> dict[str, Any]:
        d = self.degrees
        return {
            "epoch": self.epoch, "dp": d.dp, "tp": d.tp, "pp": d.pp, "ep": d.ep, "zero": d.zero,
            "ppLayers": list(d.pp_layers or ()), "members": list(self.members),
            # Always written: the status is merge-patched, so a key left out keeps its old value.
            "mirror": d.mirror,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> World:
        degrees = Degrees(
            dp=int(data["dp"]), tp=int(data["tp"]), pp=int(data["pp"]), ep=int(data["ep"]),
            zero=int(data["zero"]), pp_layers=tuple(int(n) for n in data["ppLayers"]),
            mirror=bool(data.get("mirror", False)),
        )  # fmt: skip
        return cls(int(data["epoch"]), degrees, tuple(data["members"]))


@dataclass(frozen=True)
class InFlight:
    """A reconfiguration the agents were asked to make: from `old` (None: the job's first world)
    to `new`, meeting in the store at `store`."""

    epoch: int
    reason: str
    new: World
    store: tuple[str, int]  # ("", 0) until a member hosts it
    started: float  # seconds since the epoch (time.time()) when it was decided
    old: World | None = None
    lost: tuple[str, ...] = ()
    restore: str = ""
    pods: tuple[tuple[str, str], ...] = ()  # (member, pod) of members that share a pod

    def union(self) -> list[str]:
        lost = set(self.lost)
        old = [m for m in (self.old.members if self.old else ()) if m not in lost]
        kept = set(old)
        return old + [m for m in self.new.members if m not in kept]

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "reason": self.reason,
            "new": self.new.to_dict(),
            "old": self.old.to_dict() if self.old else None,
            "store": {"host": self.store[0], "port": self.store[1]},
            "lost": list(self.lost),
            "restore": self.restore,
            "started": self.started,
            # A list, which a merge patch replaces whole (a map's keys would be merged).
            "pods": [{"member": m, "pod": pod} for m, pod in self.pods],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InFlight:
        return cls(
            epoch=int(data["epoch"]),
            reason=str(data["reason"]),
            new=World.from_dict(data["new"]),
            store=(str(data["store"]["host"]), int(data["store"]["port"])),
            old=World.from_dict(data["old"]) if data.get("old") else None,
            lost=tuple(data.get("lost") or ()),
            restore=str(data.get("restore") or ""),
            started=float(data["started"]),
            pods=tuple((str(p["member"]), str(p["pod"])) for p in data.get("pods") or ()),
        )


@dataclass(frozen=True)
class Suspension:
    """A suspension of the job: its state saved as checkpoint `number` to `path`, at `step`
    (-1 while the members are asked to save it)."""

    number: int
    path: str
    step: int = -1

    @property
    def saved(self) -> bool:
        return self.step >= 0

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "path": self.path, "step": self.step}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Suspension:
        return cls(int(data["number"]), str(data["path"]), int(data["step"]))


@dataclass(frozen=True)
class StartFailures:
    """Worker pods that failed before they became members, in a row (`start_failures`): no pod
    is created before `retry_after`. A pod scheduled after the last failure that becomes ready
    ends the row; the failed pods not deleted yet are kept by name, so that each counts once."""

    count: int = 0  # failed starts in a row
    last: str = ""  # the last one: its pod and why it failed
    at: float = 0.0  # when the last one was seen (seconds since the epoch)
    retry_after: float = 0.0  # no worker pod is created before this time
    pods: tuple[str, ...] = ()  # the failed pods not deleted yet, each counted once

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count, "last": self.last, "at": self.at,
            "retryAfter": self.retry_after, "pods": list(self.pods),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StartFailures:
        return cls(
            count=int(data.get("count", 0)), last=str(data.get("last") or ""),
            at=float(data.get("at", 0)), retry_after=float(data.get("retryAfter", 0)),
            pods=tuple(str(p) for p in data.get("pods") or ()),
        )  # fmt: skip


LEFT = 8  # partitions kept in status.rebalance.left, the latest last


@dataclass(frozen=True)
class Rebalancing:
    """What live rebalancing (`rebalance`) remembers across passes: the pipeline partitions the
    job left by rebalancing, packing or growing (a return to one of them needs twice the
    threshold); the members packing released that no grow took back (the job runs on
    `replicas - len(released)` members), and the spec.replicas they were released under (a
    change of it ends the packing); the partition a grow waits to switch to while its pods
    pre-warm."""

    left: tuple[tuple[int, ...], ...] = ()
    released: tuple[str, ...] = ()
    replicas: int = 0  # spec.replicas when the job packed (0: not packed)
    grow: tuple[int, ...] = ()  # the pp_layers a grow switches to once its pods are ready

    @property
    def packed(self) -> bool:
        return bool(self.released)

    def leaving(self, pp_layers: tuple[int, ...]) -> Rebalancing:
        """With `pp_layers` added to the partitions left (the last LEFT kept)."""
        left = tuple(p for p in self.left if p != pp_layers)
        return replace(self, left=(*left, pp_layers)[-LEFT:])

    def to_status(self) -> dict[str, Any]:
        """`status.rebalance` and `status.released` (a merge patch: None removes)."""
        state = {"left": [list(p) for p in self.left], "replicas": self.replicas or None,
                 "grow": list(self.grow) or None}  # fmt: skip
        return {"rebalance": state if self != Rebalancing() else None,
                "released": list(self.released) or None}  # fmt: skip

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Rebalancing:
        state = status.get("rebalance") or {}
        return cls(
            left=tuple(tuple(int(n) for n in p) for p in state.get("left") or ()),
            released=tuple(str(m) for m in status.get("released") or ()),
            replicas=int(state.get("replicas") or 0),
            grow=tuple(int(n) for n in state.get("grow") or ()),
        )


@dataclass(frozen=True)
class Record:
    """What one pass leaves the next one (`status.reconfiguration`; `rebalance` beside it)."""

    world: World | None = None  # None: no world has committed yet
    in_flight: InFlight | None = None
    last_epoch: int = -1  # the last epoch a reconfiguration was begun with (epochs never repeat)
    attempts: int = 0  # reconfigurations aborted in a row
    retry_after: float = 0.0  # no reconfiguration that can wait begins before this time
    restore: str = ""  # why the job must restart from its last checkpoint ("": it need not)
    silent: Mapping[str, float] = field(default_factory=dict)  # member -> silent since
    checkpoint_asked: int = 0  # the number of the last checkpoint every member was asked for
    suspended: Suspension | None = None  # the job is (being) suspended, or resumes from this
    start_failures: StartFailures = field(default_factory=StartFailures)
    rebalance: Rebalancing = field(default_factory=Rebalancing)  # status.rebalance, .released

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Record:
        """The record a pass finds in the job's status."""
        record = cls.from_dict(status.get("reconfiguration") or {})
        return replace(record, rebalance=Rebalancing.from_status(status))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        return cls(
            world=World.from_dict(data["world"]) if data.get("world") else None,
            in_flight=InFlight.from_dict(data["inFlight"]) if data.get("inFlight") else None,
            last_epoch=int(data.get("lastEpoch", -1)),
            attempts=int(data.get("attempts", 0)),
            retry_after=float(data.get("retryAfter", 0)),
            restore=str(data.get("restore") or ""),
            silent={m: float(t) for m, t in (data.get("silent") or {}).items()},
            checkpoint_asked=int(data.get("checkpointAsked", 0)),
            suspended=Suspension.from_dict(data["suspended"]) if data.get("suspended") else None,
            start_failures=StartFailures.from_dict(data.get("startFailures") or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        # A merge patch: None removes what the stored record has and this one does not.
        return {
            "world": self.world.to_dict() if self.world else None,
            "inFlight": self.in_flight.to_dict() if self.in_flight else None,
            "lastEpoch": self.last_epoch,
            "attempts": self.attempts,
            "retryAfter": self.retry_after,
            "restore": self.restore or None,
            "silent": dict(self.silent) or None,
            "checkpointAsked": self.checkpoint_asked,
            "suspended": self.suspended.to_dict() if self.suspended else None,
            "startFailures": (
                self.start_failures.to_dict() if self.start_failures != StartFailures() else None
            ),
        }
