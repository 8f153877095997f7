"""AdamW on the exact ZeRO shards the core defines, with gradients summed over every replica and
clipped by the global norm.

Per step: gradients of weights that several ranks hold partially are summed first (q/k norms over
tp, a tied embedding over its first and last stage), then every gradient is summed over its
data-parallel replicas in one flat all-reduce per reduction axis. The global norm adds, over every
shard, the squares of the gradient rows that the shard's lowest-ranked holder counts, so each
element is counted once across all axes. Adam then updates this rank's shard of the fp32 state
(the master copy, or the fp32 parameter itself when the model has no master), and the parameter
rows of the shards are shared with the replicas (ZeRO-1) or left sharded for the next gather
(ZeRO-3). Losses are normalised by the global token count, so gradients are sums, never dp means.
A weight frozen at the step (`TrainingSettings.frozen`) got no gradient (zeros: the norm is the
trained weights') and takes no update: its value, master and moments stay bit for bit.

The global norm's all-reduce also carries the step's other sums (`totals`: the loss, the members'
agreement), so it is the update's last collective: a step that fails before it completes leaves
the state as it was, and the update that follows it is local (`updating` is True only while it
runs). A member whose all-reduce failed while others' completed (a peer died inside it) keeps its
reduced gradients (`unfinished`), and can complete the same update alone (`finish`) with the
values the others summed. ZeRO-1's sharing of the updated parameter rows (`share`) comes after
the update: a world that breaks inside it leaves every shard's holders with the update and the
other replicas' rows one step old, or new where its all-reduce completed; a recovery reads the
parameters from their shard's holders (`plan.source_layout`), so the update stands.

A mirrored layout's copies of boxes no replica holds (`weights.Peers`) are updated the same way:
before the global norm's all-reduce, each rank sends the reduced gradients of those of its boxes
to the peer that holds their copy, and receives those of the copies it holds. A member that
completes the all-reduce knows every member entered it, so every copy's gradients have arrived:
whoever updates, the copies can be updated too (in the same call, bit for bit as the holder's),
and an update cut in the all-reduce finishes them with the rest.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import Work

from liveshard_core.job import TrainingSettings
from liveshard_core.vps.box import Box, box_shape, volume
from liveshard_core.vps.spec import Param, StateKind

from ..engine.backend import AdamStep, Group, adamw_all, copy_all
from ..engine.world import Axis
from . import comm
from .weights import Route, Weight, Weights, box_view


@dataclass(frozen=True)
class UpdateStats:
    grad_norm: float
    lr: float
    totals: tuple[float, ...]  # the step's `totals`, summed over the world
    # spent sending and receiving the peers' gradients (`Peers`) and not overlapped: posting
    # them, then waiting for them once this member's part of the norm is computed
    exchange_seconds: float = 0.0


@dataclass(frozen=True)
class _Exchange:
    """The peers' gradients in flight (`Optimizer._post_exchange`)."""

    incoming: dict[int, torch.Tensor]  # by the rank sending them
    works: list[Work]
    posting: float  # the seconds posting took
    copies: dict[int, Route]  # what `incoming` holds, by that rank (`Peers.copies`)

    def wait(self) -> tuple[list[torch.Tensor], float]:
        """The gradients received, one per copy in `Peers.held` order, once every send and
        receive is done; and the seconds of the exchange this member waited (posting too)."""
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        out: list[torch.Tensor] = []
        for src, route in self.copies.items():
            offset = 0
            for _, box in route:
                out.append(self.incoming[src][offset : offset + volume(box)].view(box_shape(box)))
                offset += volume(box)
        return out, self.posting + time.perf_counter() - start if self.works else 0.0


@dataclass(frozen=True)
class _Unfinished:
    """An update whose gradients are reduced but whose all-reduce did not complete here."""

    grads: dict[str, list[torch.Tensor]]
    copies: list[torch.Tensor]  # the gradients of the copies held for peers (`Peers.held`)
    step: int
    adam_step: int


class Optimizer:
    def __init__(self, weights: Weights, settings: TrainingSettings) -> None:
        self.weights = weights
        self.settings = settings
        self.has_master = StateKind.MASTER in weights.spec.kinds
        self.updating = False  # between the first write to the state and the update's end
        self.unfinished: _Unfinished | None = None  # an update cut in its all-reduce
        self.summed: tuple[float, ...] = ()  # the last update's all-reduced values

    @property
    def can_finish(self) -> bool:
        """Whether an update cut in its all-reduce can be completed alone (`finish`)."""
        return self.unfinished is not None

    @torch.no_grad()
    def step(self, step: int, adam_step: int, totals: tuple[float, ...] = ()) -> UpdateStats:
        """Apply one update with learning rate `settings.learning_rate(step)`; `adam_step` is the
        number of this update (1 for the first), for Adam's bias correction. `totals` are summed
        over the world in the global norm's all-reduce. ZeRO-1 then `share`s the updated rows."""
        weights, world = self.weights, self.weights.world
        for w in weights.all():
            for t in w.tensors:
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
            if w.tp_partial:
                _sum_grads(w, world.group(Axis.TP))
            if w.tied:
                _sum_grads(w, world.group(Axis.EMBED))
        grads: dict[str, list[torch.Tensor]] = {}
        for axis, group in weights.by_reduce().items():
            flat = torch.cat([t.grad.reshape(-1).float() for w in group for t in w.tensors])  # type: ignore[union-attr]
            comm.all_reduce(flat, world.group(axis))
            offset = 0
            for w in group:
                grads[w.name] = []
                for t in w.tensors:
                    grads[w.name].append(flat[offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()
        for w in weights.all():
            for t in w.tensors:
                t.grad = None
        # The copies' gradients travel while this member computes its part of the norm; all
        # have arrived before the norm's all-reduce, which a member completes only once every
        # member's have (what a recovery relies on: `Peers`).
        exchange = self._post_exchange(grads)
        values = self._norm_squares(grads, totals)
        copies, exchanged = exchange.wait()
        self.unfinished = _Unfinished(grads, copies, step, adam_step)
        comm.all_reduce(values, world.group(Axis.WORLD))
        self.unfinished = None
        stats = self._apply(grads, copies, tuple(values.tolist()), step, adam_step)
        return dataclasses.replace(stats, exchange_seconds=exchanged)

    def finish(self, summed: tuple[float, ...]) -> UpdateStats:
        """Complete the update cut in its all-reduce with the values the others summed (the
        members that completed it publish them): the state becomes theirs, bit for bit (ZeRO-1:
        in this member's shards; the recovery that follows shares the rest)."""
        unfinished = self.unfinished
        if unfinished is None or not self.can_finish:
            raise RuntimeError("no update to finish here")
        self.unfinished = None
        return self._apply(
            unfinished.grads, unfinished.copies, summed, unfinished.step, unfinished.adam_step
        )

    def _post_exchange(self, grads: dict[str, list[torch.Tensor]]) -> _Exchange:
        """Post the sends of the reduced gradients of this rank's boxes whose copy a peer holds,
        and the receives of those of the copies it holds (`Peers`)."""
        peers, weights = self.weights.peers, self.weights
        start = time.perf_counter()
        if not peers.sends and not peers.copies:
            return _Exchange({}, [], 0.0, peers.copies)
        outgoing = {
            dst: torch.cat([
                box_view(weights[p.name].boxes, grads[p.name], box).reshape(-1) for p, box in route
            ])
            for dst, route in peers.sends.items()
        }  # fmt: skip
        device = weights.state.device
        incoming = {
            src: torch.empty(sum(volume(box) for _, box in route), device=device)
            for src, route in peers.copies.items()
        }
        works = comm.post_exchange(outgoing, incoming, weights.world.group(Axis.WORLD), device)
        return _Exchange(incoming, works, time.perf_counter() - start, peers.copies)

    def _apply(
        self, grads: dict[str, list[torch.Tensor]], copies: list[torch.Tensor],
        summed: tuple[float, ...], step: int, adam_step: int,
    ) -> UpdateStats:  # fmt: skip
        self.summed = summed
        norm = math.sqrt(summed[0])
        self.updating = True
        scale = min(1.0, self.settings.clip_norm / (norm + 1e-6))
        lr = self.settings.learning_rate(step)
        trained = [w for w in self.weights.all() if not self.settings.frozen(step, w.param)]
        held = [
            (param, box, grad)
            for (param, box), grad in zip(self.weights.peers.held(), copies, strict=True)
            if not self.settings.frozen(step, param)
        ]
        self.adam(trained, grads, scale, lr, adam_step, held)  # a frozen weight keeps its state
        self.updating = False
        return UpdateStats(norm, lr, summed[1:])

    def share(self) -> None:
        """ZeRO-1: every replica takes the updated parameter rows of the others' shards."""
        if self.weights.layout.zero == 1:
            self.weights.sync_from_shards()

    def _norm_squares(
        self, grads: dict[str, list[torch.Tensor]], totals: tuple[float, ...]
    ) -> torch.Tensor:
        """This rank's part of the squared global gradient norm, then `totals`: what the
        update's one all-reduce sums."""
        device = self.weights.state.device
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for w in self.weights.all():
            for shard, counted in zip(w.shards, w.counted, strict=True):
                if counted:
                    squares += box_view(w.boxes, grads[w.name], shard).double().square().sum()
        return torch.cat([squares, torch.tensor(totals, dtype=torch.float64, device=device)])

    def adam(
        self, weights: list[Weight], grads: dict[str, list[torch.Tensor]], scale: float,
        lr: float, adam_step: int, copies: Sequence[tuple[Param, Box, torch.Tensor]] = (),
    ) -> None:  # fmt: skip
        """AdamW on every shard of `weights` (a mirrored layout's predecessor's shards too) and
        on the `copies` held for peers (each with its gradient), each operation on all of them
        at once (`backend.adamw_all`): per element the same arithmetic as one shard at a time,
        so the two copies of a mirrored box stay equal bit for bit."""
        s, state, spec = self.settings, self.weights.state, self.weights.spec
        g: list[torch.Tensor] = []
        m: list[torch.Tensor] = []
        v: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        params: list[torch.Tensor] = []
        decayed: list[torch.Tensor] = []
        pieces = [
            (w.param, shard, box_view(w.boxes, grads[w.name], shard))
            for w in weights
            for shard in w.shards
        ]
        for param, box, grad in [*pieces, *copies]:
            g.append(grad)
            m.append(state.view(spec.ref(param.name, StateKind.EXP_AVG), box))
            v.append(state.view(spec.ref(param.name, StateKind.EXP_AVG_SQ), box))
            stored = state.view(spec.ref(param.name), box)
            value = (
                state.view(spec.ref(param.name, StateKind.MASTER), box)
                if self.has_master else stored
            )  # fmt: skip
            values.append(value)
            params.append(stored)
            if len(param.shape) >= 2:
                decayed.append(value)
        step = AdamStep(scale, lr, s.beta1, s.beta2, s.eps, s.weight_decay, adam_step)
        adamw_all(g, m, v, values, decayed, step)
        if self.has_master:
            copy_all(params, values)


def _sum_grads(w: Weight, group: Group) -> None:
    for t in w.tensors:
        assert t.grad is not None
        comm.all_reduce(t.grad, group)
