"""Pipeline rebalancing and packing: which layers each stage holds, from measured layer costs.

A stage's time is the sum of its layers' forward+backward seconds, plus the embedding's on the
first stage and the head's on the last; its memory is the sum of its layers' bytes (plus the
embedding's and the head's). The step is paced by the slowest stage.

- `balance`: the partition of the layers, in order, into `stages` non-empty stages that minimises
  the slowest stage, exactly, under a per-device memory cap: a dynamic programme over
  (stage, last layer) in O(stages x layers^2), the minimax goal of DynMo and ElasWave. Among
  optimal partitions it takes one that moves the fewest layers off their current stage (a second
  pass of the same programme, minimising moved layers under the optimal time).
- `pack`: the fewest stages whose balanced slowest stage stays within `1 + tolerance` of today's,
  so the members of the stages given up can be released (DynMo's packing).

Pure arithmetic on the costs given; this module knows nothing of tensors or members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from ..errors import InvalidInput

_REL = 1e-12  # float slack when comparing a stage with the optimal time


@dataclass(frozen=True)
class LayerCosts:
    """Measured costs: seconds (forward+backward) and bytes per device, per layer."""

    seconds: tuple[float, ...]
    bytes: tuple[int, ...] = ()  # empty: memory is not limited
    first_seconds: float = 0.0  # the embedding, on the first stage
    last_seconds: float = 0.0  # the head (final norm, lm_head, loss), on the last stage
    first_bytes: int = 0
    last_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.seconds:
            raise InvalidInput("costs: seconds must list at least one layer")
        if any(not s >= 0 for s in self.seconds):
            raise InvalidInput(f"costs: seconds {list(self.seconds)} must all be >= 0")
        if self.bytes and len(self.bytes) != len(self.seconds):
            raise InvalidInput(
                f"costs: bytes lists {len(self.bytes)} layers but seconds {len(self.seconds)}"
            )
        if any(b < 0 for b in self.bytes):
            raise InvalidInput("costs: bytes must all be >= 0")
        for name in ("first_seconds", "last_seconds", "first_bytes", "last_bytes"):
            if not getattr(self, name) >= 0:
                raise InvalidInput(f"costs: {name}={getattr(self, name)!r} must be >= 0")

    @property
    def layers(self) -> int:
        return len(self.seconds)


@dataclass(frozen=True)
class Partition:
    """Layers per stage, and each stage's time and memory."""

    pp_layers: tuple[int, ...]
    stage_seconds: tuple[float, ...]
    stage_bytes: tuple[int, ...]

    @property
    def max_seconds(self) -> float:
        return max(self.stage_seconds)


class _Prefix:
    def __init__(self, costs: LayerCosts, stages: int) -> None:
        self.costs, self.stages = costs, stages
        self.sec = [0.0, *accumulate(costs.seconds)]
        self.mem = [0, *accumulate(costs.bytes or [0] * costs.layers)]

    def seconds(self, stage: int, a: int, b: int) -> float:
        extra = (self.costs.first_seconds if stage == 0 else 0.0) + (
            self.costs.last_seconds if stage == self.stages - 1 else 0.0
        )
        return self.sec[b] - self.sec[a] + extra

    def bytes(self, stage: int, a: int, b: int) -> int:
        extra = (self.costs.first_bytes if stage == 0 else 0) + (
            self.costs.last_bytes if stage == self.stages - 1 else 0
        )
        return self.mem[b] - self.mem[a] + extra


def evaluate(costs: LayerCosts, pp_layers: tuple[int, ...] | list[int]) -> Partition:
    """The stage times and memory of a given partition."""
    if sum(pp_layers) != costs.layers or any(n < 1 for n in pp_layers):
        raise InvalidInput(
            f"pp_layers={list(pp_layers)} must be positive and sum to the {costs.layers} layers"
        )
    prefix = _Prefix(costs, len(pp_layers))
    bounds = [0, *accumulate(pp_layers)]
    return Partition(
        tuple(pp_layers),
        tuple(prefix.seconds(s, bounds[s], bounds[s + 1]) for s in range(len(pp_layers))),
        tuple(prefix.bytes(s, bounds[s], bounds[s + 1]) for s in range(len(pp_layers))),
    )


def balance(
    costs: LayerCosts,
    stages: int,
    memory_cap: int | None = None,
    current: tuple[int, ...] | None = None,
) -> Partition:
    """The partition into `stages` stages with the smallest slowest stage (module docstring)."""
    if not 1 <= stages <= costs.layers:
        raise InvalidInput(f"stages={stages} must be between 1 and the {costs.layers} layers")
    prefix = _Prefix(costs, stages)
    fits = _fits(prefix, memory_cap)
    best = _minimax(prefix, fits)
    if best is None:
        raise InvalidInput(
            f"memory cap {memory_cap} bytes: no partition of {costs.layers} layers into {stages} "
            f"stages fits (the largest layer needs {max(costs.bytes, default=0)} bytes, the "
            f"embedding {costs.first_bytes} and the head {costs.last_bytes}); raise the cap or "
            "use more stages"
        )
    owner = _owners(current, costs.layers)
    pp_layers = _fewest_moves(prefix, fits, best * (1 + _REL) + 1e-300, owner)
    return evaluate(costs, pp_layers)


def pack(
    costs: LayerCosts,
    current: tuple[int, ...],
    tolerance: float = 0.05,
    memory_cap: int | None = None,
) -> Partition:
    """The fewest stages (at most today's) whose balanced slowest stage is within
    `1 + tolerance` of today's slowest stage."""
    if not tolerance >= 0:
        raise InvalidInput(f"tolerance={tolerance!r} must be >= 0")
    today = evaluate(costs, current).max_seconds
    for stages in range(1, len(current) + 1):
        try:
            candidate = balance(costs, stages, memory_cap, current)
        except InvalidInput:
            continue  # these stages cannot hold the layers under the cap
        if candidate.max_seconds <= today * (1 + tolerance) * (1 + _REL):
            return candidate
    return balance(costs, len(current), memory_cap, current)


_Fits = Callable[[int, int, int], bool]


def _fits(prefix: _Prefix, cap: int | None) -> _Fits:
    def fits(stage: int, a: int, b: int) -> bool:
        return cap is None or prefix.bytes(stage, a, b) <= cap

    return fits


def _minimax(prefix: _Prefix, fits: _Fits) -> float | None:
    """The smallest slowest stage over all partitions that fit, or None."""
    n, p = prefix.costs.layers, prefix.stages
    inf = float("inf")
    # best[b]: the smallest slowest stage of the first b layers in stages 0..s
    best = [inf] * (n + 1)
    for b in range(1, n - p + 2):
        if fits(0, 0, b):
            best[b] = prefix.seconds(0, 0, b)
    for s in range(1, p):
        nxt = [inf] * (n + 1)
        for b in range(s + 1, n - (p - s - 1) + 1):
            for a in range(s, b):
                if best[a] < inf and fits(s, a, b):
                    nxt[b] = min(nxt[b], max(best[a], prefix.seconds(s, a, b)))
        best = nxt
    return None if best[n] == inf else best[n]


def _owners(current: tuple[int, ...] | None, layers: int) -> list[int]:
    if current is None or sum(current) != layers:
        return [-1] * layers
    return [s for s, count in enumerate(current) for _ in range(count)]


def _fewest_moves(prefix: _Prefix, fits: _Fits, limit: float, owner: list[int]) -> list[int]:
    """A partition whose every stage fits and takes at most `limit` seconds, moving the fewest
    layers off their current stage (`owner`); the earliest cut wins ties."""
    n, p = prefix.costs.layers, prefix.stages
    stays = [[0] * (n + 1) for _ in range(p)]  # stays[s][b]: layers < b whose owner is s
    for s in range(p):
        for i in range(n):
            stays[s][i + 1] = stays[s][i] + (owner[i] == s)
    big = n + 1
    cost = [big] * (n + 1)
    cuts: list[list[int]] = [[-1] * (n + 1) for _ in range(p)]
    for b in range(1, n - p + 2):
        if fits(0, 0, b) and prefix.seconds(0, 0, b) <= limit:
            cost[b] = b - stays[0][b]
            cuts[0][b] = 0
    for s in range(1, p):
        nxt = [big] * (n + 1)
        for b in range(s + 1, n - (p - s - 1) + 1):
            for a in range(s, b):
                if cost[a] < big and fits(s, a, b) and prefix.seconds(s, a, b) <= limit:
                    moved = cost[a] + (b - a) - (stays[s][b] - stays[s][a])
                    if moved < nxt[b]:
                        nxt[b], cuts[s][b] = moved, a
        cost = nxt
    assert cost[n] < big, "the optimal time must be reachable"
    bounds, b = [n], n
    for s in range(p - 1, 0, -1):
        b = cuts[s][b]
        bounds.append(b)
    bounds.append(0)
    bounds.reverse()
    return [bounds[i + 1] - bounds[i] for i in range(p)]
