"""The vote that ends every switch: each member's failure flag and checksums, added up over the
union group within the switch deadline, then one decision recorded in the change's store.

Every member that completes the all-reduce holds the same sums and so draws the same view
(`decide`). What the checksums are depends on the verification (`modes.Verification`): none, the
moved bytes as sent and as received per receiving member, or the whole old and new state per
logical tensor; the vote only carries two vectors that must agree.

A member that dies inside the all-reduce can let it complete at some members and fail at others,
so views can differ. None is acted on as it is: each member proposes its view as the epoch's
decision with a compare-and-set (`settle`), and every member acts on the one recorded first. A
recorded commit is safe for a member whose own view failed: the all-reduce completed somewhere
only if every member had voted yes, so every member's shadow is whole and checked. Whoever else
gives the epoch up (a member dropping it, the operator or the launcher answering a death)
records an abort the same way, so a late commit can never overtake it. The decision is sealed
with the job's credential under a key only members can name (`sealed`): a process without it can
neither record one first nor have a member act on one it wrote. This module decides; the switch
(`switch.Reconfiguration`) acts on the decision.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from liveshard_core.vps.spec import ModelSpec

from . import keys
from .backend import Group
from .checksum import Checksums, MovedSums
from .errors import Cause, DecisionUnknown, ForgedValue
from .modes import Verification
from .sealed import JobStore


@dataclass(frozen=True)
class Failure:
    """Why a switch aborts, as this member knows it."""

    cause: Cause
    reason: str


@dataclass(frozen=True)
class Tally:
    """The vote's sums: members that voted no, and the two checksum vectors added up."""

    failed: int
    before: torch.Tensor
    after: torch.Tensor


def cast(
    group: Group,
    *,
    failed: bool,
    before: torch.Tensor,
    after: torch.Tensor,
    deadline: float,
    device: torch.device,
) -> Tally:
    """All-reduce this member's ballot; raises RuntimeError when the vote cannot complete (a
    member died, or the deadline passed)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=device)
    ballot = torch.cat([flag, before.to(torch.int64), after.to(torch.int64)])
    options = AllreduceOptions()
    options.reduceOp = ReduceOp.SUM
    options.timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    group.allreduce([ballot], options).wait()
    n = before.numel()
    return Tally(int(ballot[0]), ballot[1 : 1 + n], ballot[1 + n :])


def reduce_ints(
    group: Group, values: list[int], op: ReduceOp.RedOpType, deadline: float, device: torch.device
) -> list[int]:
    """All-reduce a list of integers with `op` (SUM, MAX) over `group` within the deadline."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    options = AllreduceOptions()
    options.reduceOp = op
    options.timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    group.allreduce([tensor], options).wait()
    return [int(v) for v in tensor.tolist()]


def decide(
    group: Group,
    *,
    failure: Failure | None,
    verification: Verification,
    state_sums: tuple[Checksums, Checksums],
    moved: MovedSums | None,
    spec: ModelSpec,
    members: tuple[str, ...],
    epoch: int,
    deadline: float,
    device: torch.device,
) -> Failure | None:
    """All-reduce this member's `failure` and checksums over the union `group` (`members` by
    slot); the outcome's failure, or None to commit. Every member that completes the vote
    reaches the same decision. `state_sums` are the whole old and new state's checksums (with
    `Verification.STATE`), `moved` the moved bytes' (with `Verification.MOVED`)."""
    if verification is Verification.STATE:
        before, after = state_sums[0].flat, state_sums[1].flat
    elif verification is Verification.MOVED and moved is not None:
        before, after = moved.totals()
    else:
        before = after = torch.zeros(0, dtype=torch.int64, device=device)
    try:
        tally = cast(
            group, failed=failure is not None, before=before, after=after, deadline=deadline,
            device=device,
        )  # fmt: skip
    except RuntimeError as err:
        return failure or Failure(
            Cause.VOTE_INCOMPLETE, f"epoch {epoch}: the vote did not complete: {err}"
        )
    if tally.failed:
        if failure is not None:
            return failure
        return Failure(Cause.VOTE_NO, f"epoch {epoch}: {tally.failed} member(s) voted no")
    if verification is Verification.STATE:
        total_old = Checksums.from_flat(spec, tally.before)
        total_new = Checksums.from_flat(spec, tally.after)
        names = [spec.tensor_name(ref) for ref in total_old.differing(total_new)[:5]]
        what = f"checksums differ after the transfer for {names}"
    else:
        slots = MovedSums.differing(tally.before, tally.after)
        names = [members[s] for s in slots[:5]]
        what = f"the bytes received by {names} differ from the bytes sent to them"
    if names:
        return Failure(Cause.CHECKSUM_MISMATCH, f"epoch {epoch}: {what}")
    return None


def settle(store: JobStore, epoch: int, proposal: Failure | None) -> Failure | None:
    """Record `proposal` (None: commit) as `epoch`'s decision, sealed, unless one was recorded
    first, and return the recorded one: the decision every member acts on. Raises
    `DecisionUnknown` when the store cannot be reached, or when the value there does not carry
    the job's seal (`ForgedValue`: never acted on, and a forger may have overwritten a decision
    some members read already): the caller alone knows whether its view can stand without it
    (`stands_alone`)."""
    mine = {"commit": True} if proposal is None else {
        "cause": proposal.cause.value, "reason": proposal.reason
    }  # fmt: skip
    key = keys.decision(epoch, store.tag(epoch))
    try:
        recorded = json.loads(store.first(key, json.dumps(mine)))
    except ForgedValue as err:
        raise DecisionUnknown(f"epoch {epoch}: the decision cannot be read: {err}") from err
    except RuntimeError as err:  # torch's: the store's host is gone
        raise DecisionUnknown(
            f"epoch {epoch}: the store failed before the decision could be recorded or read: "
            + f"{err}".split("\n")[0]
        ) from err
    if recorded.get("commit"):
        return None
    return Failure(Cause(recorded["cause"]), str(recorded["reason"]))


def stands_alone(voted_no: bool, view: Failure | None) -> bool:
    """Whether a member may act on its own view of the vote when the decision cannot be read:
    an abort where no commit can have been recorded anywhere (it voted no, or its all-reduce
    completed with a no or a checksum mismatch, which every member that completed it saw too).
    A commit, or an all-reduce that failed here (it may have completed at the others, all yes),
    cannot: the member is undecided until told which was recorded."""
    return voted_no or (view is not None and view.cause is not Cause.VOTE_INCOMPLETE)
