"""One training step of one rank: its stage's micro-batches in the order of the pipeline schedule
(`pipeline_schedule`: GPipe or 1F1B), then the update.

A forward receives its input from the previous stage and sends its output to the next over the pp
group; a backward receives its output's gradient from the next stage and sends its input's
gradient to the previous one, as the stage's program (`pipeline_schedule.stage_program`) posts
them: one group call per action on NCCL, one message at a time on gloo. Receives are waited for
before their pass; sends are posted without waiting, so no stage ever waits on a stage that waits
on it. A send is waited for once its receiver is known to have received it (something the
receiver sent later in its own order has arrived), the rest at the end of the step: a
micro-batch's saved activations are freed when its backward has run, its output when the next
stage's backward of it has come back.

The loss of a micro-batch is its tokens' cross-entropy sum divided by the global batch's token
count, plus its MoE auxiliary loss divided by the number of micro-batches in the global batch:
summed over micro-batches and replicas it is the global batch's mean loss, whatever the
data-parallel degree.

Where every layer before a stage's is frozen at the step (`TrainingSettings.freeze`), no gradient
flows back to its input: it asks for none, and sends the previous stage zeros where the schedule
sends an input gradient, so the messages are those of any step; a stage whose output needs no
gradient runs no backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed import Work

from liveshard_core.policy.rebalance import StepCosts

from ..engine import backend
from ..engine.backend import Group
from ..engine.world import Axis
from .costs import job_share
from .data import Dataset
from .model import StageModel
from .optimizer import Optimizer, UpdateStats
from .pipeline_schedule import Message, Pass, PipelineSchedule, stage_order, stage_program

Order = list[tuple[Pass, int]]


@dataclass(frozen=True)
class StepStats:
    loss: float  # the global batch's mean cross-entropy per token
    aux_loss: float  # the MoE auxiliary loss, averaged over micro-batches (0 for dense models)
    update: UpdateStats
    samples: tuple[int, ...]  # the samples this rank fed in (first stage, tp rank 0), else ()
    agreement: tuple[float, ...]  # the `agreement` values, summed over the world
    costs: StepCosts  # the step's compute seconds, job-wide (`costs`)


def train_step(
    model: StageModel,
    optimizer: Optimizer,
    dataset: Dataset,
    *,
    step: int,
    adam_step: int,
    first_sample: int,
    agreement: Callable[[], tuple[float, ...]] = tuple,
) -> StepStats:
    """Train `step` on the global batch of samples `first_sample ..`; `adam_step` numbers the
    update (1 for the first). `agreement`'s values are summed over the world in the update's
    all-reduce (the global norm's, which also sums the loss), so that members can agree on
    something at every step boundary without a collective of its own. They are asked for just
    before it, after the backward: what ended during the step (a prepare) is said in it."""
    weights, settings = model.weights, model.settings
    layout = weights.layout
    pp_i, dp_i, tp_i = layout.coords(weights.rank)
    micro = settings.micro_batches(layout.dp)
    schedule = PipelineSchedule(settings.pipeline_schedule)

    weights.gather()
    stage = _Stage(
        model, dataset, step,
        first_sample + dp_i * (settings.global_batch // layout.dp),
        orders=[stage_order(schedule, layout.pp, i, micro) for i in range(layout.pp)],
        feeds=model.first and tp_i == 0,
    )  # fmt: skip
    for action in stage_program(schedule, layout.pp, pp_i, micro):
        received = stage.post(action.messages)
        if action.run is None:
            continue
        kind, m = action.run
        if kind is Pass.FORWARD:
            stage.forward(m, received)
        else:
            stage.backward(m, received)
    for work in [*stage.to_next.values(), *stage.to_prev.values()]:
        work.wait()
    # The loss lives on the last stage, the auxiliary loss on every stage; tp ranks hold copies.
    # They are summed in the update's one all-reduce over the world, with the agreement values.
    totals = (
        stage.ce_sum if model.last and tp_i == 0 else 0.0,
        stage.aux_sum if tp_i == 0 else 0.0,
    )
    # So are the step's measured costs: each rank adds its layers' share.
    share = job_share(model.clock.collect(), model.cfg.layers, layout.world_size // layout.pp)
    agreed = agreement()
    update = optimizer.step(step, adam_step, (*totals, *agreed, *share))
    total_micro = settings.global_batch // settings.micro_batch
    summed = update.totals[2:]
    return StepStats(
        loss=update.totals[0] / settings.tokens_per_step,
        aux_loss=update.totals[1] / total_micro,
        update=update,
        samples=tuple(stage.fed),
        agreement=summed[: len(agreed)],
        costs=StepCosts.from_vector(summed[len(agreed) :]),
    )


@dataclass
class _Stage:
    """One step's passes on this rank: what its micro-batches saved for their backwards, the
    outputs not yet posted, the sends not yet waited for, the loss sums."""

    model: StageModel
    dataset: Dataset
    step: int
    first_sample: int  # this replica's first
    orders: list[Order]  # every stage's order: a peer's tells which of our sends it received
    feeds: bool  # whether this rank reports the samples it fed in
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # by micro-batch: its input (None on the first stage), its output or loss, its aux term
    outbox: dict[tuple[Pass, int], torch.Tensor] = field(default_factory=dict)  # to be sent
    to_next: dict[int, Work] = field(default_factory=dict)  # outputs, by micro-batch
    to_prev: dict[int, Work] = field(default_factory=dict)  # input gradients, by micro-batch
    ce_sum: float = 0.0
    aux_sum: float = 0.0
    fed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        weights, settings = self.model.weights, self.model.settings
        self.pp_i = weights.layout.coords(weights.rank)[0]
        self.micro = len(self.orders[0]) // 2
        self.device = weights.state.device
        self.dtype = weights.all()[0].tensors[0].dtype
        self.shape = (settings.micro_batch, settings.seq_len, self.model.cfg.hidden)
        self.aux_scale = settings.aux_loss_coef / (settings.global_batch // settings.micro_batch)
        # Where every layer before this stage's is frozen (the input embedding with them), no
        # gradient flows back to the stage's input: it asks for none.
        frozen = settings.frozen_layers(self.step)
        self.input_grad = frozen == 0 or frozen < self.model.layers.start

    @property
    def pp(self) -> Group:
        return self.model.weights.world.group(Axis.PP)

    def post(self, messages: tuple[Message, ...]) -> torch.Tensor | None:
        """Post `messages` (one group call on NCCL) and wait for the one receive among them;
        returns what it received."""
        if not messages:
            return None
        group, coalesce = self.pp, backend.coalesces(self.device)
        if coalesce:
            backend.start_coalescing(group, self.device)
        works: list[Work] = []
        received = None
        for message in messages:
            tag = message.micro + (self.micro if message.carries is Pass.BACKWARD else 0)
            if message.send:
                buffer = self.outbox.pop((message.carries, message.micro))
                works.append(group.send([buffer], message.peer, tag))
            else:
                received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                works.append(group.recv([received], message.peer, tag))
        if coalesce:
            works = [backend.end_coalescing(group, self.device)] * len(messages)
        for message, work in zip(messages, works, strict=True):
            if message.send:
                sends = self.to_next if message.peer > self.pp_i else self.to_prev
                sends[message.micro] = work
            else:
                work.wait()
                # The peer ran every pass before the one that sent this: those of its passes
                # that receive our messages have received them.
                reached = (message.carries, message.micro)
                if message.peer < self.pp_i:
                    self._settle(self.to_prev, self.orders[message.peer], reached)
                else:
                    self._settle(self.to_next, self.orders[message.peer], reached)
        return received

    def forward(self, m: int, hidden: torch.Tensor | None) -> None:
        model, settings = self.model, self.model.settings
        batch = self.dataset.batch(
            self.first_sample + m * settings.micro_batch, settings.micro_batch, self.device
        )
        if self.feeds:
            self.fed += batch.samples.tolist()
        if hidden is not None and self.input_grad:
            hidden.requires_grad_(True)
        out = model.forward(batch, hidden, self.step)
        aux = out.aux if out.aux is not None else torch.zeros((), device=self.device)
        self.aux_sum += float(aux.detach())
        aux_term = aux * self.aux_scale
        if model.last:
            assert out.loss_sum is not None
            self.ce_sum += float(out.loss_sum.detach())
            loss = out.loss_sum / settings.tokens_per_step + aux_term
            self.saved[m] = (hidden, loss, aux_term)
        else:
            assert out.hidden is not None
            self.outbox[(Pass.FORWARD, m)] = out.hidden.detach().contiguous()
            self.saved[m] = (hidden, out.hidden, aux_term)

    def backward(self, m: int, grad: torch.Tensor | None) -> None:
        hidden, output, aux_term = self.saved.pop(m)
        self.model.clock.backward_begin()
        if self.model.last:
            torch.autograd.backward([output])  # the loss, its own aux term included
        else:
            assert grad is not None
            outputs: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            if output.requires_grad:  # not where every layer up to here is frozen
                outputs.append(output)
                grads.append(grad)
            if aux_term.requires_grad:  # MoE layers on this stage that train
                outputs.append(aux_term)
                grads.append(torch.ones_like(aux_term))
            if outputs:
                torch.autograd.backward(outputs, grads)
        self.model.clock.backward_end()
        if hidden is not None:
            # The schedule sends the previous stage an input gradient: zeros where none flows.
            if not hidden.requires_grad:
                self.outbox[(Pass.BACKWARD, m)] = torch.zeros_like(hidden)
            else:
                assert hidden.grad is not None
                self.outbox[(Pass.BACKWARD, m)] = hidden.grad.contiguous()

    @staticmethod
    def _settle(sends: dict[int, Work], peer: Order, reached: tuple[Pass, int]) -> None:
        """Wait for the sends to `peer` whose receiving pass comes before `reached` in its
        order: they have completed, so waiting cannot block. `reached` is what `peer` sent us
        (a backward from the next stage, a forward from the previous one), the receiving
        passes the other kind (the next stage's forwards take our outputs, the previous
        stage's backwards our input gradients)."""
        receiving = Pass.BACKWARD if reached[0] is Pass.FORWARD else Pass.FORWARD
        for kind, m in peer[: peer.index(reached)]:
            work = sends.pop(m, None) if kind is receiving else None
            if work is not None:
                work.wait()
