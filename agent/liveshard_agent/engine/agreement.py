"""What the members of a change agree on in prepare, before any byte moves: through the store,
that the epoch is new to this store and that every member computed the same plan with the same
settings; over the union group, the traffic the whole plan puts on each pair of members.

They run in prepare (`switch.Reconfiguration`), on the prepare thread's own store client, and
raise the engine's errors (`EpochReused`, `PrepareTimeout`, `PlanMismatch`, `ForgedValue`) that
end prepare, or torch's when the union's all-reduce fails. The digests are sealed (`sealed`); the
counters cannot be, and are out of a forger's reach under the epoch's tag. This module must not
build groups or move state.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from liveshard_core.plan.schedule import Traffic, member_traffic
from liveshard_core.plan.view import MemberPlan
from liveshard_core.vps.box import volume

from . import keys
from .backend import Group
from .errors import EpochReused, PlanMismatch, PrepareTimeout
from .modes import Verification
from .sealed import JobStore
from .vote import reduce_ints


def claim_epoch(store: JobStore, epoch: int, member: str) -> None:
    """Refuse an epoch this member already used on this store: its keys would mislead."""
    uses = store.add(keys.claimed(epoch, store.tag(epoch), member), 1)
    if uses != 1:
        raise EpochReused(
            f"epoch {epoch} was already used by {member} on this store; "
            "every reconfiguration takes a new epoch number"
        )


def agree_on_digest(
    store: JobStore,
    *,
    epoch: int,
    member: str,
    members: tuple[str, ...],
    digest: str,
    budget: int,
    verification: Verification,
    timeout: float,
) -> None:
    """Publish this member's plan digest, with the settings every member must share (the
    budget, which cuts the rounds, and the verification, which shapes the vote), and check
    that every member of the union `members` published the same, within `timeout` seconds. A
    few store operations per member, whatever the number of members: each counts itself under
    its digest and among those that published, the last to publish says so; only a failure
    reads the members' digests one by one (sealed: `ForgedValue` for one that is not), to name
    who is missing or differs."""
    prefix = keys.digest_prefix(epoch, store.tag(epoch))
    agreed = f"{digest} budget={budget} verify={verification.value}"
    same = prefix + "count/" + hashlib.sha256(agreed.encode()).hexdigest()
    store.put(prefix + member, agreed)
    store.add(same, 1)
    if store.add(prefix + "published", 1) == len(members):
        store.put(prefix + "all", "1")
    published = [prefix + m for m in members]
    try:
        store.wait([prefix + "all"], timedelta(seconds=timeout))
    except RuntimeError:
        missing = [m for m, k in zip(members, published, strict=True) if not store.check([k])]
        raise PrepareTimeout(
            f"epoch {epoch}: members {missing} published no plan digest within {timeout} s"
        ) from None
    if store.add(same, 0) == len(members):
        return
    differ = [m for m, k in zip(members, published, strict=True) if store.get(k) != agreed]
    raise PlanMismatch(
        f"epoch {epoch}: members {differ} computed a different plan or settings "
        f"than {member} (digest {digest[:12]}, budget {budget}, "
        f"verification {verification.value}); they disagree about the model, "
        "layouts, members, budget or verification"
    )


def agree_on_traffic(
    union: Group, part: MemberPlan, deadline: float, device: torch.device
) -> tuple[Traffic, int]:
    """The whole plan's traffic, united from every member's part (one all-reduce over the
    union), and the bytes the whole plan sends over the network, added up over the union."""
    own = member_traffic(part)
    traffic = own.from_vector(reduce_ints(union, own.vector(), ReduceOp.MAX, deadline, device))
    (network_bytes,) = reduce_ints(union, [_sent_bytes(part)], ReduceOp.SUM, deadline, device)
    return traffic, network_bytes


def _sent_bytes(part: MemberPlan) -> int:
    """The bytes the member sends in the whole switch."""
    return sum(
        volume(p.box) * cls.itemsize * len(cls)
        for pattern, cls in part.groups
        for p in part.network[pattern]
        if p.src == part.slot
    )
