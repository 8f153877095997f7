"""Every key the agent writes in a job's store, in one place, so that no two uses collide.

A job's store outlives its worlds: keys are scoped by the epoch that uses them (a reconfiguration
or the first world), and an epoch is used once (`agreement.claim_epoch`), so stale keys of an
earlier epoch are never read as current ones. The engine, the runtime and the local launcher all
build their keys here; this module only names keys, it must not touch a store.
"""

from __future__ import annotations

_ROOT = "liveshard"


def group_prefix(epoch: int, axis: str, key: str) -> str:
    """The prefix a world's process group along `axis` meets under; `key` tells apart the
    groups of one axis (the member's coordinates on the other axes)."""
    return f"{_ROOT}/{epoch}/{axis}/{key}"


def union_prefix(epoch: int) -> str:
    """The prefix the union group of a change's old and new members meets under."""
    return f"{_ROOT}/{epoch}/union"


def claimed(epoch: int, member: str) -> str:
    """Counts how often `member` used `epoch` on this store (it may only once)."""
    return f"{_ROOT}/{epoch}/claimed/{member}"


def digest_prefix(epoch: int) -> str:
    """The prefix under which a change's members publish and count their plan digests."""
    return f"{_ROOT}/{epoch}/digest/"


def announcement(epoch: int) -> str:
    """A change's announcement: the switch step and scalars, or an abort (the first one stands)."""
    return f"{_ROOT}/{epoch}/announce"


def decision(epoch: int) -> str:
    """A switch's decision, commit or abort: the first one recorded stands (`vote.settle`)."""
    return f"{_ROOT}/{epoch}/decision"


def breakage(epoch: int, member: str) -> str:
    """Where `member`'s world broke, published for the recovery `epoch`."""
    return f"{_ROOT}/{epoch}/broken/{member}"


def restore_prefix(epoch: int) -> str:
    """The prefix the members of a first world restoring a checkpoint meet under."""
    return f"{_ROOT}/{epoch}/restore"


def checkpoint_prefix(epoch: int, step: int, number: int) -> str:
    """The prefix the members of world `epoch` meet under to save checkpoint `number` at `step`
    (each attempt its own: a failed one may have left keys behind)."""
    return f"{_ROOT}/{epoch}/checkpoint/{step}/{number}"


def kill(step: int, rank: int, phase: str) -> str:
    """Counts the members that reached a scripted kill (`local.faults`): only the first dies."""
    return f"{_ROOT}/kill/{step}:{rank}:{phase}"
