"""Every key the agent writes in a job's store, in one place, so that no two uses collide.

A job's store outlives its worlds: keys are scoped by the epoch that uses them (a reconfiguration
or the first world), and an epoch is used once (`agreement.claim_epoch`), so stale keys of an
earlier epoch are never read as current ones. Every key of an epoch also carries the epoch's
`tag`, a secret derived from the job's credential (`sealed.Seal.tag`): a process without the
credential cannot name the keys, so it cannot write a decision or an announcement before the
members do (the first one stands). The engine, the runtime and the local launcher all build their
keys here; this module only formats keys, it must not touch a store or derive tags.
"""

from __future__ import annotations

_ROOT = "liveshard"


def _epoch(epoch: int, tag: str) -> str:
    if not tag:
        raise ValueError(f"epoch {epoch}: tag={tag!r}: every key of an epoch needs its tag")
    return f"{_ROOT}/{epoch}/{tag}"


def group_prefix(epoch: int, tag: str, axis: str, key: str) -> str:
    """The prefix a world's process group along `axis` meets under; `key` tells apart the
    groups of one axis (the member's coordinates on the other axes)."""
    return f"{_epoch(epoch, tag)}/{axis}/{key}"


def union_prefix(epoch: int, tag: str) -> str:
    """The prefix the union group of a change's old and new members meets under."""
    return f"{_epoch(epoch, tag)}/union"


def claimed(epoch: int, tag: str, member: str) -> str:
    """Counts how often `member` used `epoch` on this store (it may only once)."""
    return f"{_epoch(epoch, tag)}/claimed/{member}"


def digest_prefix(epoch: int, tag: str) -> str:
    """The prefix under which a change's members publish and count their plan digests."""
    return f"{_epoch(epoch, tag)}/digest/"


def announcement(epoch: int, tag: str) -> str:
    """A change's announcement: the switch step and scalars, or an abort (the first one stands)."""
    return f"{_epoch(epoch, tag)}/announce"


def decision(epoch: int, tag: str) -> str:
    """A switch's decision, commit or abort: the first one recorded stands (`vote.settle`)."""
    return f"{_epoch(epoch, tag)}/decision"


def breakage(epoch: int, tag: str, member: str) -> str:
    """Where `member`'s world broke, published for the recovery `epoch`."""
    return f"{_epoch(epoch, tag)}/broken/{member}"


def restore_prefix(epoch: int, tag: str) -> str:
    """The prefix the members of a first world restoring a checkpoint meet under."""
    return f"{_epoch(epoch, tag)}/restore"


def checkpoint_prefix(epoch: int, tag: str, step: int, number: int) -> str:
    """The prefix the members of world `epoch` meet under to save checkpoint `number` at `step`
    (each attempt its own: a failed one may have left keys behind)."""
    return f"{_epoch(epoch, tag)}/checkpoint/{step}/{number}"


def kill(step: int, rank: int, phase: str) -> str:
    """Counts the members that reached a scripted kill (`local.faults`): only the first dies.
    The one key without a tag: the test harness's, read by no member's decision."""
    return f"{_ROOT}/kill/{step}:{rank}:{phase}"
