"""One type for the deadlines of a job, short to long (DESIGN.md section 7)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..errors import InvalidInput


@dataclass(frozen=True)
class Deadlines:
    """Seconds: one collective operation (creating a group, one operation outside a switch) <=
    the switch (transfer, checksums and vote) <= the prepare (plan, digest agreement, building
    the worlds). A deadline that passes aborts; nothing waits longer."""

    op: float = 30.0
    switch: float = 120.0
    prepare: float = 300.0

    def __post_init__(self) -> None:
        for name in ("op", "switch", "prepare"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise InvalidInput(f"{name}={value!r} must be a positive number of seconds")
            object.__setattr__(self, name, float(value))
        if not self.op <= self.switch <= self.prepare:
            raise InvalidInput(
                f"op={self.op} <= switch={self.switch} <= prepare={self.prepare} must hold"
            )

    @property
    def silent(self) -> float:
        """How long a member may take to say its world broke once a peer's did: the collective
        it waits in fails within `op`, and it may have entered that collective up to another
        `op` later (still computing, or waiting in an earlier one). One that says nothing for
        longer is dead or hung."""
        return 2 * self.op

    @classmethod
    def from_dict(cls, data: Any) -> Deadlines:
        """From `{"op": s, "switch": s, "prepare": s}` (any may be left out: its default)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            raise InvalidInput(
                f'deadlines={data!r} must be an object with "op", "switch" and "prepare" seconds'
            )
        for name, raw in data.items():
            if type(raw) not in (int, float):
                raise InvalidInput(f"deadlines.{name}={raw!r} must be a number of seconds")
        try:
            return cls(**{name: float(raw) for name, raw in data.items()})
        except InvalidInput as err:
            raise InvalidInput(f"deadlines: {err}") from None

    def as_dict(self) -> dict[str, float]:
        return {"op": self.op, "switch": self.switch, "prepare": self.prepare}

    @property
    def total(self) -> float:
        return self.op + self.switch + self.prepare
