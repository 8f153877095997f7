"""The vote that ends every switch: each member's failure flag and checksums, added up over the
union group within the switch deadline.

Every member that completes the all-reduce holds the same sums and so draws the same decision
(`switch.Reconfiguration._vote`). What the checksums are depends on the verification
(`modes.Verification`): none, the moved bytes as sent and as received per receiving member, or
the whole old and new state per logical tensor; the vote only carries two vectors that must agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from .backend import Group


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
