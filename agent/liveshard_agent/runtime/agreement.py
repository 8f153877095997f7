"""What every training member adds to each step's last all-reduce: its readiness for the pending
change and the due checkpoint, so that the world agrees on switching and checkpointing without a
collective of its own.

A `Readiness` is one member's numbers (`of`); summed over the world (the same field by field) it
says whether every member has the same change and checkpoint pending, how many prepared or
failed, and the switch step they share. Equality of n values is read from their count, sum and
sum of squares (`same`), so one sum carries it. Every member reads the same summed values, and so
draws the same decision. This module computes; it must not act on the member.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

NONE = -1  # no change or checkpoint pending; a change's switch step while it is held


@dataclass(frozen=True)
class Readiness:
    """One member's readiness, or (after the all-reduce) the world's sum of them."""

    members: float  # 1 per member: the world's size once summed
    epoch: float  # the pending change's epoch (NONE: none)
    epoch_squared: float
    prepared: float  # 1 if its prepare finished well
    failed: float  # 1 if its prepare failed
    at_step: float  # the change's switch step (NONE: held)
    at_step_squared: float
    checkpoint: float  # the due checkpoint's number (NONE: none)
    checkpoint_squared: float

    @classmethod
    def of(
        cls, *, epoch: int, prepared: bool, failed: bool, at_step: int, checkpoint: int
    ) -> Readiness:
        return cls(
            1.0, epoch, epoch * epoch, float(prepared), float(failed), at_step,
            at_step * at_step, checkpoint, checkpoint * checkpoint,
        )  # fmt: skip

    def to_vector(self) -> tuple[float, ...]:
        return astuple(self)

    @classmethod
    def from_vector(cls, values: tuple[float, ...]) -> Readiness:
        if len(values) != len(fields(cls)):
            raise ValueError(
                f"a readiness vector has {len(fields(cls))} values, not {len(values)}: {values}"
            )
        return cls(*values)

    # ---- read on the world's sum ----

    @property
    def same_checkpoint(self) -> bool:
        """Every member has the same checkpoint due."""
        return self.checkpoint >= 0 and same(self.members, self.checkpoint, self.checkpoint_squared)

    @property
    def same_change(self) -> bool:
        """Every member has the same change pending."""
        return self.epoch >= 0 and same(self.members, self.epoch, self.epoch_squared)

    def switch_step(self) -> float | None:
        """The step every member may switch at, once all have prepared with the same one; None
        while some have not, or the change is held somewhere."""
        if self.prepared < self.members or self.at_step < 0:
            return None
        if not same(self.members, self.at_step, self.at_step_squared):
            return None
        return self.at_step / self.members


def same(count: float, total: float, squares: float) -> bool:
    """Whether `count` values with this sum and sum of squares are all equal (Cauchy-Schwarz;
    exact in float64 for the small integers summed here)."""
    return count * squares == total * total
