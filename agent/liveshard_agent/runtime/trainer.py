"""A member's trainer in one world: its model, optimizer, data and the scalars of training.

The scalars (`Scalars`: the next step, Adam's update count, the samples consumed, the seed) are
carried explicitly: they are what a switch agrees on besides the tensors, what a checkpoint saves
next to them, and what a joining member starts from. The data cursor is `samples`: step `s` of a
job that never changed its global batch starts at sample `s * global_batch`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from liveshard_core.errors import InvalidInput
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.policy.rebalance import StepCosts
from liveshard_core.vps.spec import ModelSpec, Param, StateKind

from ..engine.state import ShardedState, flat_index, held_bytes_of
from ..engine.world import World
from . import rng
from .data import Dataset
from .model import StageModel
from .optimizer import Optimizer
from .pipeline import StepStats, train_step
from .weights import Weights


@dataclass(frozen=True)
class Scalars:
    """Training state that is not a tensor; identical on every member."""

    step: int = 0  # the next step to train
    adam_step: int = 0  # optimizer updates applied
    samples: int = 0  # samples consumed: step * global_batch
    seed: int = 0

    def advanced(self, global_batch: int) -> Scalars:
        return replace(
            self, step=self.step + 1, adam_step=self.adam_step + 1,
            samples=self.samples + global_batch,
        )  # fmt: skip

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scalars:
        return cls(**{k: int(data[k]) for k in ("step", "adam_step", "samples", "seed")})


def _std(param: Param, layers: int) -> float:
    """Initial standard deviation: 0.02, residual outputs scaled down by depth; norms are 1."""
    if len(param.shape) == 1:
        return 0.0  # norms start at one, biases at zero
    if param.name.endswith((".o", ".down")):
        return 0.02 / math.sqrt(2 * layers)
    return 0.02


@torch.no_grad()
def initial_state(
    spec: ModelSpec, layout: Layout, rank: int, seed: int, device: torch.device
) -> ShardedState:
    """The rank's boxes of the initial training state: parameters (and masters) from
    counter-based randomness over their global index, moments zero. Any layout gets the same
    values for the same global index."""
    state = ShardedState.allocate(spec, layout, rank, device)
    for ref, box, tensor in state.items():
        if ref.kind not in (StateKind.PARAM, StateKind.MASTER):
            continue
        param = spec.params[ref.param]
        std = _std(param, spec.config.layers)
        if std == 0.0:
            tensor.fill_(0.0 if param.name.endswith("_bias") else 1.0)
            continue
        base = rng.key("init", seed, param.name)
        index = flat_index(param.shape, box, device)
        # Uniform with the wanted standard deviation: +-sqrt(3) * std.
        values = (rng.uniform(base, index) * 2 - 1) * (3**0.5 * std)
        tensor.copy_(values)
    return state


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    aux_loss: float
    grad_norm: float
    lr: float
    seconds: float
    samples: tuple[int, ...]  # the samples this rank fed in (first stage, tp rank 0), else ()
    agreement: tuple[float, ...]  # the step's agreement values summed over the world
    costs: StepCosts = field(default_factory=lambda: StepCosts(()))  # job-wide (`costs`)
    exchange_seconds: float = 0.0  # sending and receiving the peers' gradients (mirrored layouts)


class Trainer:
    """Trains one member's part of the model in one world."""

    def __init__(
        self,
        *,
        state: ShardedState,
        world: World,
        settings: TrainingSettings,
        dataset: Dataset,
        scalars: Scalars,
    ) -> None:
        if scalars.seed != settings.seed:
            raise InvalidInput(f"scalars seed {scalars.seed} != settings seed {settings.seed}")
        settings.micro_batches(state.layout.dp)  # rejects a layout the global batch cannot fill
        self.settings = settings
        self.dataset = dataset
        self.scalars = scalars
        self.world = world
        self.bind(state, world)

    def bind(self, state: ShardedState, world: World) -> None:
        """Compute with `state` in `world` from now on (after a committed switch); a world left
        is closed in the background."""
        if world is not self.world:
            self.world.close()
        self.state, self.world = state, world
        # Set after a rebuild (the same layout again, none lost): a world that broke inside
        # ZeRO-1's sharing left replicas' rows one step old, so the first step shares again.
        self.reshare = False
        self._held: tuple[int, int] | None = None  # `held_bytes`, once asked
        self.weights = Weights.build(state, world)
        self.model = StageModel(self.weights, self.settings)
        self.optimizer = Optimizer(self.weights, self.settings)

    @property
    def layout(self) -> Layout:
        return self.state.layout

    def held_bytes(self) -> tuple[int, int]:
        """The state bytes this member holds, and of them the copies it holds for others (its
        predecessor's ZeRO shards, a peer's boxes: `Layout.mirror`): what the mirror costs it."""
        if self._held is None:
            # From the geometry: the storage may be released by a switch meanwhile.
            self._held = held_bytes_of(self.state.spec, self.state.layout, self.state.rank)
        return self._held

    @property
    def whole(self) -> bool:
        """Whether the state holds every update before `scalars.step` and nothing of the next
        (False only after a step failed in the middle of its update; ZeRO-1's rows of other
        members' shards may be one step old, see `step`)."""
        return not self.optimizer.updating

    def finish_step(self, summed: tuple[float, ...]) -> None:
        """Complete the step whose update was cut in its all-reduce, with the values the members
        that completed it summed (`Optimizer.finish`); the scalars advance as theirs did."""
        self.optimizer.finish(summed)
        self.scalars = self.scalars.advanced(self.settings.global_batch)

    def step(
        self,
        agreement: Callable[[], tuple[float, ...]] = tuple,
        stepped: Callable[[StepRecord], None] | None = None,
    ) -> StepRecord:
        """Train step `scalars.step` and advance the scalars; `agreement`'s values, asked for
        after the backward, come back summed over the world (see `pipeline.train_step`).
        `stepped` is told the step's record once its update is applied, before ZeRO-1 shares
        the updated rows (`Optimizer.share`): a world that breaks in the sharing leaves the step
        trained, its record told, its update in this member's shards and the other rows waiting
        for the recovery (`plan.source_layout`)."""
        if self.reshare:
            self.optimizer.share()
            self.reshare = False
        start = time.perf_counter()
        scalars = self.scalars
        stats: StepStats = train_step(
            self.model, self.optimizer, self.dataset, step=scalars.step,
            adam_step=scalars.adam_step + 1, first_sample=scalars.samples, agreement=agreement,
        )  # fmt: skip
        record = StepRecord(
            step=self.scalars.step, loss=stats.loss, aux_loss=stats.aux_loss,
            grad_norm=stats.update.grad_norm, lr=stats.update.lr,
            seconds=time.perf_counter() - start, samples=stats.samples,
            agreement=stats.agreement, costs=stats.costs,
            exchange_seconds=stats.update.exchange_seconds,
        )  # fmt: skip
        self.scalars = self.scalars.advanced(self.settings.global_batch)
        if stepped is not None:
            stepped(record)
        self.optimizer.share()
        return record
