"""Mixture-of-experts layers: a top-k router, all-to-all token dispatch over the ep group, and
experts that are SwiGLU MLPs split across tp like the dense one.

No token is dropped: an expert takes every token routed to it (there is no capacity limit to
overflow), so the result of a token does not depend on which other tokens share its batch. The
load-balancing auxiliary loss (Switch Transformer's: experts x sum over experts of the fraction
of routed tokens times the mean router probability) is computed per micro-batch, whose samples do
not depend on the layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..engine.world import Axis
from . import comm

if TYPE_CHECKING:
    from .model import StageModel


def moe_forward(
    model: StageModel, layer: int, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block of `layer` on `h` [batch, seq, hidden]; returns its output and aux loss."""
    cfg, weights = model.cfg, model.weights
    prefix = f"layers.{layer}.mlp."
    tokens = h.reshape(-1, h.shape[-1])
    (router,) = model.tensors(prefix + "router")
    probs = torch.softmax((tokens @ router.T).float(), dim=-1)
    top_probs, top_experts = probs.topk(cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
    gates = top_probs.to(h.dtype)
    fraction = torch.bincount(top_experts.flatten(), minlength=cfg.experts).float()
    fraction = fraction / top_experts.numel()
    aux = cfg.experts * (fraction * probs.mean(0)).sum()

    # Every (token, choice) row, ordered by expert, goes to the ep rank that holds the expert.
    choices = top_experts.flatten()
    order = torch.argsort(choices, stable=True)
    experts = choices[order]
    rows = tokens[order // cfg.top_k]
    layout = weights.layout
    per_rank = cfg.experts // layout.ep
    send = torch.bincount(experts // per_rank, minlength=layout.ep).tolist()
    ep = weights.world.group(Axis.EP)
    received, receive = comm.all_to_all(rows, ep, send)
    received_experts, _ = comm.all_to_all(experts.unsqueeze(1), ep, send)
    received_experts = received_experts.squeeze(1)

    # The received rows, grouped by expert (stably: each expert's rows keep their order), run
    # through their experts one contiguous slice each: one host sync for the slices' sizes,
    # whatever the number of experts. A rank that received no row still returns a tensor in the
    # graph (zero rows of `received`): it takes part in the backward's all-to-alls, as its peers
    # do (from a plain empty tensor, no gradient would reach it and its peers would wait in a
    # collective it never posts).
    grouped = torch.argsort(received_experts, stable=True)
    sizes = torch.bincount(received_experts, minlength=cfg.experts).tolist()
    shared = comm.copy_to(received, model.tp)[grouped]
    outputs = [
        model.swiglu(f"{prefix}experts.{expert}.", rows_of_expert)
        for expert, rows_of_expert in enumerate(torch.split(shared, sizes))
        if len(rows_of_expert)
    ]
    out = torch.cat(outputs)[torch.argsort(grouped)] if outputs else received * 0
    returned, _ = comm.all_to_all(out, ep, receive)

    combined = torch.zeros_like(tokens)
    weights_of_rows = gates.flatten()[order].unsqueeze(1)
    combined = combined.index_add(0, order // cfg.top_k, returned * weights_of_rows)
    return combined.view_as(h), aux
