"""The one module that touches torch's private or backend-specific distributed API.

Everything else imports public names from `torch.distributed`. Here live:
- group construction straight from a store (gloo for CPU, NCCL for CUDA, with NCCL's options);
- coalescing a round of point-to-point operations into one NCCL group call;
- copying many small tensors in one call (`copy_all`, torch's multi-tensor `_foreach_copy_`), and
  AdamW on many shards in one call per operation (`adamw_all`);
- ShardedTensors with explicit global metadata, which `torch.distributed.checkpoint` needs to save
  and load arbitrary boxes (the public constructor all-gathers metadata and rejects replicas).
As TorchFT's `process_group.py` does, each backend's private calls stay inside one function, so a
torch upgrade that moves them breaks here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
from torch.distributed import (
    AllreduceOptions,
    AllToAllOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    Work,
)


class Group(Protocol):
    """What liveshard uses of a backend's process group (ProcessGroupGloo, ProcessGroupNCCL)."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work: ...
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...
    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> Work: ...
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions,
    ) -> Work: ...
    def abort(self) -> None: ...
    def shutdown(self) -> None: ...


def new_group(
    store: Store, *, prefix: str, rank: int, size: int, device: torch.device, timeout: float
) -> Group:
    """A process group of `size` members under `prefix`; every member calls this with its rank.

    Built directly, never registered with torch.distributed's default group, so groups of a new
    world can be created while the old world's groups work."""
    prefixed = PrefixStore(prefix, store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        group = ProcessGroupNCCL(prefixed, rank, size, options)
        # NCCL builds a communicator at its group's first collective: inside a switch's pause or
        # the new world's first step. Built here instead, while the old world trains; every
        # member of the group blocks here until all have come.
        index = device.index if device.index is not None else torch.cuda.current_device()
        group.eager_connect_single_device(torch.device("cuda", index))
        return cast(Group, group)
    return cast(Group, ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout)))


def coalesces(device: torch.device) -> bool:
    """Whether a round's operations on `device` are posted as one group call (NCCL)."""
    return device.type == "cuda"


def start_coalescing(group: Group, device: torch.device) -> None:
    """Open a group call: the operations posted until `end_coalescing` run as one (what
    `batch_isend_irecv` does inside; it refuses groups that are not registered)."""
    group._start_coalescing(device)  # type: ignore[attr-defined]


def end_coalescing(group: Group, device: torch.device) -> Work:
    return cast(Work, group._end_coalescing(device))  # type: ignore[attr-defined]


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """`targets[i].copy_(sources[i])` for every i, in one call: a packed message's pieces cost
    one dispatch instead of one each."""
    if targets:
        torch._foreach_copy_(targets, sources)


@dataclass(frozen=True)
class AdamStep:
    """The scalars of one AdamW update."""

    scale: float  # the gradients' clipping factor
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_step: int  # the update's number (1 for the first), for the bias corrections


def adamw_all(
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    values: list[torch.Tensor],
    decayed: list[torch.Tensor],
    step: AdamStep,
) -> None:
    """AdamW on every `values[i]` with `grads[i]` and its moments, decaying the `decayed`
    ones (some of `values`), each operation on all tensors in one call (torch's multi-tensor
    `_foreach_*`): per element the same arithmetic as one tensor at a time."""
    if not grads:
        return
    bias1 = 1 - step.beta1**step.adam_step
    bias2 = 1 - step.beta2**step.adam_step
    g = torch._foreach_mul(grads, step.scale)
    torch._foreach_mul_(exp_avgs, step.beta1)
    torch._foreach_add_(exp_avgs, g, alpha=1 - step.beta1)
    torch._foreach_mul_(exp_avg_sqs, step.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1 - step.beta2)
    denom = torch._foreach_div(exp_avg_sqs, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, step.eps)
    if decayed and step.weight_decay:
        torch._foreach_mul_(decayed, 1 - step.lr * step.weight_decay)
    torch._foreach_addcdiv_(values, exp_avgs, denom, value=-step.lr / bias1)


def sharded_tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    placed_boxes: list[tuple[tuple[tuple[int, int], ...], int]],
    local: dict[tuple[tuple[int, int], ...], torch.Tensor],
    rank: int,
) -> torch.Tensor:
    """A ShardedTensor of global `shape` whose metadata places each box on a rank; the boxes
    placed on `rank` are its local shards, backed by the tensors in `local` (no copy). No
    collective runs: every rank computes the metadata from the layout."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    device = next(iter(local.values())).device if local else torch.device("cpu")
    metas, shards = [], []
    for box, owner in placed_boxes:
        meta = ShardMetadata(
            shard_offsets=[lo for lo, _ in box],
            shard_sizes=[hi - lo for lo, hi in box],
            placement=f"rank:{owner}/{device}",
        )
        metas.append(meta)
        if owner == rank:
            shards.append(Shard(local[box], meta))
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
    metadata = ShardedTensorMetadata(metas, torch.Size(shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)
