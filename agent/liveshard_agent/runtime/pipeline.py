"""One training step of one rank: the GPipe schedule over micro-batches, then the update.

Every stage runs the forward of all its micro-batches in order (receiving each input from the
previous stage and sending each output to the next over the pp group), then their backwards in
reverse order (receiving output gradients from the next stage and sending input gradients to the
previous one). Sends are posted without waiting and waited for before the step ends, so no stage
ever waits on a stage that waits on it. The loss of a micro-batch is its tokens' cross-entropy sum
divided by the global batch's token count, plus its MoE auxiliary loss divided by the number of
micro-batches in the global batch: summed over micro-batches and replicas it is the global batch's
mean loss, whatever the data-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import Work

from ..engine.world import Axis
from .data import Dataset
from .model import StageModel
from .optimizer import Optimizer, UpdateStats


@dataclass(frozen=True)
class StepStats:
    loss: float  # the global batch's mean cross-entropy per token
    aux_loss: float  # the MoE auxiliary loss, averaged over micro-batches (0 for dense models)
    update: UpdateStats
    samples: tuple[int, ...]  # the samples this rank fed in (first stage, tp rank 0), else ()
    agreement: tuple[float, ...]  # the `agreement` values, summed over the world


def train_step(
    model: StageModel,
    optimizer: Optimizer,
    dataset: Dataset,
    *,
    step: int,
    adam_step: int,
    first_sample: int,
    agreement: tuple[float, ...] = (),
) -> StepStats:
    """Train `step` on the global batch of samples `first_sample ..`; `adam_step` numbers the
    update (1 for the first). `agreement` values are summed over the world in the update's
    all-reduce (the global norm's, which also sums the loss), so that members can agree on
    something at every step boundary without a collective of its own."""
    weights, settings = model.weights, model.settings
    layout, world = weights.layout, weights.world
    pp_i, dp_i, tp_i = layout.coords(weights.rank)
    micro = settings.micro_batches(layout.dp)
    total_micro = settings.global_batch // settings.micro_batch
    first_sample += dp_i * (settings.global_batch // layout.dp)
    tokens = settings.tokens_per_step
    pp = world.group(Axis.PP)
    device = weights.state.device
    dtype = weights.all()[0].tensors[0].dtype
    shape = (settings.micro_batch, settings.seq_len, model.cfg.hidden)

    weights.gather()
    sends: list[Work] = []
    saved: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
    ce_sum = aux_sum = 0.0
    fed: list[int] = []
    for m in range(micro):
        batch = dataset.batch(first_sample + m * settings.micro_batch, settings.micro_batch)
        if model.first and tp_i == 0:
            fed += batch.samples.tolist()
        hidden = None
        if not model.first:
            hidden = torch.empty(shape, dtype=dtype, device=device)
            pp.recv([hidden], pp_i - 1, m).wait()
            hidden.requires_grad_(True)
        out = model.forward(batch, hidden, step)
        aux = out.aux if out.aux is not None else torch.zeros((), device=device)
        aux_sum += float(aux.detach())
        aux_term = aux * (settings.aux_loss_coef / total_micro)
        if model.last:
            assert out.loss_sum is not None
            ce_sum += float(out.loss_sum.detach())
            saved.append((hidden, out.loss_sum / tokens + aux_term, aux_term))
        else:
            assert out.hidden is not None
            sends.append(pp.send([out.hidden.detach().contiguous()], pp_i + 1, m))
            saved.append((hidden, out.hidden, aux_term))
    for m in reversed(range(micro)):
        hidden, output, aux_term = saved.pop()
        if model.last:
            torch.autograd.backward([output])  # the loss, its own aux term included
        else:
            grad = torch.empty(shape, dtype=dtype, device=device)
            pp.recv([grad], pp_i + 1, micro + m).wait()
            outputs, grads = [output], [grad]
            if aux_term.requires_grad:  # MoE layers on this stage
                outputs.append(aux_term)
                grads.append(torch.ones_like(aux_term))
            torch.autograd.backward(outputs, grads)
        if hidden is not None:
            assert hidden.grad is not None
            sends.append(pp.send([hidden.grad.contiguous()], pp_i - 1, micro + m))
    for work in sends:
        work.wait()
    # The loss lives on the last stage, the auxiliary loss on every stage; tp ranks hold copies.
    # They are summed in the update's one all-reduce over the world, with the agreement values.
    totals = (ce_sum if model.last and tp_i == 0 else 0.0, aux_sum if tp_i == 0 else 0.0)
    update = optimizer.step(step, adam_step, (*totals, *agreement))
    return StepStats(
        loss=update.totals[0] / tokens,
        aux_loss=update.totals[1] / total_micro,
        update=update,
        samples=tuple(fed),
        agreement=update.totals[2:],
    )
