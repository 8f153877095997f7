"""Live rebalancing (DynMo's loop): from measured layer costs to a better pipeline partition.

Every member times its layers each step; summed over the world they are one job-wide vector per
step (`StepCosts`), and a `CostWindow` keeps the last `window_steps` of them, read as each
layer's median (one slow step does not move it). From a full window, `propose` decides:

- The predicted step time of a partition is its slowest stage times `(m + p - 1) / m` for `m`
  micro-batches per replica on `p` stages (the bubble of GPipe and 1F1B alike).
- The candidate is the best partition (`pipeline.balance`, under the per-device memory cap) on
  today's number of stages; with `pack`, on any number up to `max_stages`: the fewest stages
  whose predicted step is within half the threshold of the best (the work fits on fewer members,
  the rest are released), and more stages again when the work grows back.
- A switch is proposed when the candidate's predicted step beats today's by more than
  `threshold`, and the time won over the next window of steps exceeds the switch's predicted
  pause. A pack is proposed when it costs at most half the threshold; it wins members, not time.
- Hysteresis: the caller restarts the window after every switch (costs are measured again in the
  new partition before the next decision), and returning to a partition left before needs twice
  the threshold, so noise cannot swing the job between two partitions.

Pure arithmetic; it knows nothing of members or tensors.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..errors import InvalidInput
from ..job.rebalance import RebalanceSettings
from .pipeline import LayerCosts, Partition, balance, evaluate

REBALANCE, PACK, GROW = "rebalance", "pack", "grow"


@dataclass(frozen=True)
class StepCosts:
    """One step's compute seconds, forward and backward, summed over its micro-batches: each
    layer's, the embedding's (`first`) and the head's (`last`); job-wide (the mean over the
    ranks that hold each)."""

    layers: tuple[float, ...]
    first: float = 0.0
    last: float = 0.0

    def vector(self) -> tuple[float, ...]:
        return (*self.layers, self.first, self.last)

    @classmethod
    def from_vector(cls, values: tuple[float, ...] | list[float]) -> StepCosts:
        if len(values) < 2:
            raise InvalidInput(f"step costs need the layers, first and last: got {values}")
        return cls(tuple(values[:-2]), values[-2], values[-1])


class CostWindow:
    """The last `steps` steps' costs; `median` once it is full."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.seen: deque[StepCosts] = deque(maxlen=steps)

    def add(self, costs: StepCosts) -> None:
        if self.seen and len(self.seen[0].layers) != len(costs.layers):
            raise InvalidInput(
                f"step costs of {len(costs.layers)} layers after {len(self.seen[0].layers)}"
            )
        self.seen.append(costs)

    def clear(self) -> None:
        self.seen.clear()

    @property
    def full(self) -> bool:
        return len(self.seen) == self.steps

    def median(self) -> StepCosts | None:
        """Each value's median over the window; None while it is empty."""
        if not self.seen:
            return None
        columns = zip(*(c.vector() for c in self.seen), strict=True)
        return StepCosts.from_vector([statistics.median(col) for col in columns])


def layer_costs(costs: StepCosts, memory: tuple[tuple[int, ...], int, int] | None) -> LayerCosts:
    """`costs` as the partitioner reads them, with the bytes per device of each layer, the
    embedding and the head (`policy.model.state_bytes_per_layer`) when memory is limited."""
    layer_bytes, first_bytes, last_bytes = memory or ((), 0, 0)
    return LayerCosts(costs.layers, layer_bytes, costs.first, costs.last, first_bytes, last_bytes)


def step_seconds(partition: Partition, micro_batches: int) -> float:
    """The predicted step time of `partition` with `micro_batches` per replica."""
    stages = len(partition.pp_layers)
    return partition.max_seconds * (micro_batches + stages - 1) / micro_batches


def stage_times(costs: StepCosts, pp_layers: tuple[int, ...]) -> tuple[float, ...]:
    """Each stage's seconds: its layers', with the embedding's on the first, the head's on the
    last."""
    return evaluate(layer_costs(costs, None), pp_layers).stage_seconds


def imbalance(costs: StepCosts, pp_layers: tuple[int, ...]) -> float:
    """The slowest stage over the mean stage (1.0: balanced)."""
    stages = stage_times(costs, pp_layers)
    mean = sum(stages) / len(stages)
    return max(stages) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Proposal:
    """A switch to `pp_layers`: `kind` is REBALANCE (as many stages), PACK (fewer) or GROW
    (more); the predicted step times and the switch's predicted pause."""

    kind: str
    pp_layers: tuple[int, ...]
    step_seconds_before: float
    step_seconds_after: float
    pause_seconds: float
    imbalance_before: float
    imbalance_after: float

    @property
    def gain(self) -> float:
        """The predicted share of the step time won (negative: lost, for a pack)."""
        return 1 - self.step_seconds_after / self.step_seconds_before


def propose(
    settings: RebalanceSettings,
    costs: StepCosts,
    pp_layers: tuple[int, ...],
    micro_batches: int,
    pause: Callable[[tuple[int, ...]], float],
    *,
    max_stages: int | None = None,
    left: Collection[tuple[int, ...]] = (),
    memory: tuple[tuple[int, ...], int, int] | None = None,
    memory_cap: int | None = None,
) -> Proposal | None:
    """The switch the costs call for, or None (module docstring). `pause(pp_layers)` predicts
    the pause of a switch to that partition; `left`: partitions the job left before;
    `max_stages`: the most stages packing may grow back to (default today's)."""
    measured = layer_costs(costs, memory)
    today = evaluate(measured, pp_layers)
    before = step_seconds(today, micro_batches)
    if before <= 0:
        return None
    stages = len(pp_layers)
    counts = range(1, max(max_stages or stages, stages) + 1) if settings.pack else [stages]
    options = {}
    for count in counts:
        if count > len(costs.layers):
            break
        try:
            options[count] = balance(measured, count, memory_cap, pp_layers)
        except InvalidInput:
            continue  # these stages cannot hold the layers under the cap
    if not options:
        return None
    predicted = {count: step_seconds(p, micro_batches) for count, p in options.items()}
    best = min(predicted.values())
    fewest = min(c for c, s in predicted.items() if s <= best * (1 + settings.threshold / 2))
    chosen = options[fewest]
    after = step_seconds(chosen, micro_batches)
    if chosen.pp_layers == tuple(pp_layers):
        return None
    kind = PACK if fewest < stages else GROW if fewest > stages else REBALANCE
    # The pause is predicted (a transfer plan) only for a candidate the step times call for.
    if kind == PACK:
        if after > before * (1 + settings.threshold / 2):
            return None
        seconds = pause(chosen.pp_layers)
    else:
        needed = settings.threshold * (2 if chosen.pp_layers in left else 1)
        won = before - after
        if won <= needed * before:
            return None
        seconds = pause(chosen.pp_layers)
        if won * settings.window_steps <= seconds:
            return None
    return Proposal(
        kind, chosen.pp_layers, before, after, seconds,
        imbalance(costs, pp_layers), imbalance(costs, chosen.pp_layers),
    )  # fmt: skip
