"""The job's status conditions (Ready, Reconfiguring, Degraded, Suspended, Succeeded, Failed), in
the standard metav1.Condition shape: a transition time that moves only when the status flips, the
generation observed, and terminal conditions (Succeeded, Failed) that stay once true. A transition
is stamped with the time the caller gives (the pass's), else the clock's.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

TERMINAL = ("Succeeded", "Failed")


def stamp(now: float | None) -> str:
    """`now` (else the clock's time) as a Kubernetes timestamp."""
    moment = datetime.now(UTC) if now is None else datetime.fromtimestamp(now, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds(stamp: str, unreadable: float) -> float:
    """A timestamp in seconds since the epoch; `unreadable` when it cannot be read."""
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return unreadable


class Conditions:
    def __init__(
        self, items: list[dict[str, Any]], generation: int, now: float | None = None
    ) -> None:
        self.items = [dict(c) for c in items]
        self.generation = generation
        self.now = now

    def get(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.items if c.get("type") == kind), None)

    def terminal(self) -> bool:
        return any((c := self.get(kind)) is not None and c["status"] == "True" for kind in TERMINAL)

    def set(self, kind: str, status: bool, reason: str, message: str) -> None:
        value = "True" if status else "False"
        current = self.get(kind)
        if current is not None and kind in TERMINAL and current["status"] == "True":
            return  # terminal conditions are sticky
        fresh = {
            "type": kind, "status": value, "reason": reason or "None", "message": message,
            "observedGeneration": self.generation,
            "lastTransitionTime": stamp(self.now) if current is None or current["status"] != value
            else current["lastTransitionTime"],
        }  # fmt: skip
        if current is None:
            self.items.append(fresh)
        else:
            current.update(fresh)
