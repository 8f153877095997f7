"""Collectives for the parallel model, on the current world's groups, with their gradients.

The engine's groups are built directly from a store and are not registered with
torch.distributed, so the `torch.distributed.*` functions cannot take them: every collective here
calls the group's own methods. The autograd functions are the usual tensor-parallel pair (`f`:
identity forward, all-reduce backward; `g`: all-reduce forward, identity backward), an
all-to-all whose backward is the reverse all-to-all (expert dispatch), and the vocabulary-parallel
cross-entropy. A group of one member costs nothing.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed import AllreduceOptions, AllToAllOptions, ReduceOp, Work

from ..engine import backend
from ..engine.backend import Group


def all_reduce(tensor: torch.Tensor, group: Group, op: ReduceOp.RedOpType = ReduceOp.SUM) -> None:
    """Reduce `tensor` in place across `group`."""
    if group.size() == 1:
        return
    options = AllreduceOptions()
    options.reduceOp = op
    group.allreduce([tensor], options).wait()


def post_exchange(
    outgoing: dict[int, torch.Tensor],
    incoming: dict[int, torch.Tensor],
    group: Group,
    device: torch.device,
) -> list[Work]:
    """Post the send of `outgoing[r]` to member r of `group` and the receive of `incoming[r]`
    from member r; what to wait for. Every operation is posted before any is waited for (one
    group call on NCCL), so members exchanging round a ring cannot deadlock; the caller computes
    meanwhile, and reads `incoming` only once every one is waited for."""
    coalesce = backend.coalesces(device)
    if coalesce:
        backend.start_coalescing(group, device)
    works = [group.send([t], r, 0) for r, t in outgoing.items()]
    works += [group.recv([t], r, 0) for r, t in incoming.items()]
    return [backend.end_coalescing(group, device)] if coalesce else works


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity; the gradient is summed across `group` (before a column-parallel layer)."""
    return x if group.size() == 1 else _CopyToGroup.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum across `group` (after a row-parallel layer); the gradient passes through."""
    return x if group.size() == 1 else _ReduceFromGroup.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, send: list[int], receive: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return _all_to_all(x, group, send, receive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.receive, ctx.send), None, None, None


def _all_to_all(x: torch.Tensor, group: Group, send: list[int], receive: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    group.alltoall_base(out, x.contiguous(), receive, send, AllToAllOptions()).wait()
    return out


def all_to_all(x: torch.Tensor, group: Group, send: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Send rows `x[sum(send[:j]) : sum(send[:j+1])]` to member j of `group`; returns the rows
    received, in member order, and how many came from each member."""
    if group.size() == 1:
        return x, send
    counts = torch.tensor(send, dtype=torch.int64, device=x.device)
    received = torch.empty_like(counts)
    group.alltoall_base(
        received, counts, [1] * len(send), [1] * len(send), AllToAllOptions()
    ).wait()
    receive = received.tolist()
    return _AllToAll.apply(x, group, send, receive), receive


def all_gather(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Every member's `tensor`, stacked in member order (no gradient)."""
    if group.size() == 1:
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    group.allgather([out], [tensor.contiguous()]).wait()
    return torch.stack(out)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """One all-gather per call: each member's log-sum-exp over its vocabulary slice and its
    slice's target logit (zero where the target lies elsewhere)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Group
    ) -> torch.Tensor:
        logits = logits.float()
        vocab = logits.shape[-1]
        mine = (targets >= start) & (targets < start + vocab)
        local = (targets - start).clamp(0, vocab - 1)
        target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        gathered = all_gather(torch.stack([logits.logsumexp(dim=-1), target]), group)
        total = gathered[:, 0].logsumexp(dim=0)
        ctx.save_for_backward(logits, total, local, mine)
        return total - gathered[:, 1].sum(dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, total, local, mine = ctx.saved_tensors
        out = (logits - total.unsqueeze(-1)).exp_()
        out.scatter_add_(-1, local.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        return out * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, group: Group
) -> torch.Tensor:
    """Per-token cross-entropy (float32) of `logits` [tokens, vocab slice] whose columns are
    vocabulary entries `start ..` of the whole vocabulary, split across `group`."""
    return cast(torch.Tensor, _VocabParallelCrossEntropy.apply(logits, targets, start, group))
