"""The operator's record of a job's world and of a reconfiguration in flight, as kept in the job's
status (`status.reconfiguration`), so that a restarted operator knows both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from liveshard_core.layout.layout import Layout
from liveshard_core.vps.spec import ModelSpec


@dataclass(frozen=True)
class World:
    """The layout in effect (or to come), with its members in rank order."""

    epoch: int
    dp: int
    tp: int
    pp: int
    ep: int
    zero: int
    pp_layers: tuple[int, ...]
    members: tuple[str, ...]

    @classmethod
    def of(cls, epoch: int, layout: Layout) -> World:
        return cls(
            epoch, layout.dp, layout.tp, layout.pp, layout.ep, layout.zero, layout.pp_layers,
            layout.members,
        )  # fmt: skip

    def layout(self, spec: ModelSpec) -> Layout:
        return Layout.create(
            spec, self.members, dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, zero=self.zero,
            pp_layers=self.pp_layers,
        )  # fmt: skip

    def describe(self) -> str:
        stages = ":".join(map(str, self.pp_layers))
        return (
            f"dp={self.dp},tp={self.tp},pp={self.pp},ep={self.ep},zero={self.zero},"
            f"pp_layers={stages}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep,
            "zero": self.zero, "ppLayers": list(self.pp_layers), "members": list(self.members),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> World:
        return cls(
            int(data["epoch"]), int(data["dp"]), int(data["tp"]), int(data["pp"]),
            int(data["ep"]), int(data["zero"]), tuple(data["ppLayers"]), tuple(data["members"]),
        )  # fmt: skip


@dataclass(frozen=True)
class InFlight:
    """A reconfiguration the agents were asked to make: from `old` (None: the job's first world)
    to `new`, meeting in the store at `store`."""

    epoch: int
    reason: str
    new: World
    store: tuple[str, int]
    old: World | None = None
    lost: tuple[str, ...] = ()
    restore: str = ""
    started: float = field(default_factory=time.time)

    def union(self) -> list[str]:
        old = [m for m in (self.old.members if self.old else ()) if m not in self.lost]
        return old + [m for m in self.new.members if m not in old]

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
        )
