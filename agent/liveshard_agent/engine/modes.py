"""The switch's modes: how it checks the bytes it moved, and how much device memory it may hold.

Both are chosen per `Reconfiguration` (`verify=`, `memory=`) and reported in its `SwitchRecord`.
Every member of a change must use the same verification (the vote carries its checksums; prepare
refuses a member that differs); the memory mode is each member's own business.
"""

from __future__ import annotations

from enum import Enum


class Verification(Enum):
    """What the vote compares before a switch may commit."""

    NONE = "none"  # nothing: the bytes are trusted to the transport (TCP for gloo)
    MOVED = "moved"  # the bytes that cross the network, checksummed as they are sent and as they
    # arrive, while the transfer runs: costs in proportion to what moves
    STATE = "state"  # the whole old state against the whole new state, tensor by tensor: also
    # catches a wrong plan or a bad local copy, at the cost of reading both states in the pause

    @classmethod
    def of(cls, verify: bool | Verification) -> Verification:
        """`True` is `MOVED`, `False` is `NONE`."""
        if isinstance(verify, Verification):
            return verify
        if isinstance(verify, bool):
            return cls.MOVED if verify else cls.NONE
        raise TypeError(f"verify must be a bool or a Verification, got {verify!r}")


class MemoryMode(Enum):
    """How a member holds its old state and its shadow during a switch."""

    RESIDENT = "resident"  # both on the device: the whole shadow is allocated in prepare, and an
    # abort keeps the old state untouched; costs up to the new state's size again
    BOUNDED = "bounded"  # the old state is copied to host memory at the switch and its device
    # storage given back as the transfer no longer needs it; the shadow is allocated box by box
    # as it is filled, and boxes kept whole are passed on as they are. Peak extra device memory
    # stays within the budget plus the member's own growth; an abort restores the old state
    # from the host copy, bit for bit
