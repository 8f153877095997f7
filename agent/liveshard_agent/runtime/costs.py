"""What each step's layers cost on this rank: compute seconds, forward and backward, per layer.

A stage's forward stamps the clock at every layer boundary (after the embedding, after each
layer, after the loss), and hooks the hidden state there: autograd calls the hook when that
state's gradient is complete, just before the backward of what made it runs, and the hook stamps
the clock (it returns nothing: the gradient is unchanged). The time between two stamps is charged
to what ran between them: a layer, the embedding (`first`) or the head (`last`). Spans open and
close within one forward or one backward of one micro-batch, so waiting for a pipeline peer is
never counted; a layer's own collectives (tp's all-reduces, the MoE all-to-all) are, as part of
its cost. A frozen layer that no gradient crosses is charged nothing for its backward. On CPU the
stamps are the monotonic clock (autograd runs a CPU backward on the calling thread); on GPUs they
are CUDA events on the current stream, read once per step (`collect`).

The cost: a stamp per layer per micro-batch and direction, and a tensor hook; the vector goes in
the step's one all-reduce (`job_share`), no collective of its own.
"""

from __future__ import annotations

import time
from typing import Any

import torch

FIRST, LAST = -1, -2  # the embedding's and the head's slots; layers are their index


class LayerClock:
    """One rank's stamps for one step; `collect` sums them per slot and starts the next step."""

    def __init__(self, layers: range, first: bool, last: bool, device: torch.device) -> None:
        self.layers, self.first, self.last = layers, first, last
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[int, Any, Any]] = []  # (slot, start, end)
        self.stamp: Any = None
        self.open: int | None = None  # the slot the time since `stamp` goes to

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _charge(self, next_slot: int | None) -> None:
        now = self._now()
        if self.open is not None and self.stamp is not None:
            self.spans.append((self.open, self.stamp, now))
        self.stamp, self.open = now, next_slot

    # ---- forward ----

    def begin(self) -> None:
        """A forward begins: the embedding runs next on the first stage."""
        self.stamp, self.open = self._now(), FIRST if self.first else None

    def boundary(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """The hidden state before layer `index` of the stage's (`len(layers)`: after the last):
        charges what ran since the last stamp, hooks `x` for the backward."""
        after = LAST if self.last else None
        self._charge(self.layers[index] if index < len(self.layers) else after)
        if x.requires_grad:
            x.register_hook(lambda grad: self.crossed(index))  # type: ignore[no-untyped-call]
        return x

    def end(self) -> None:
        """The forward ended: the head (or nothing, on other stages) ran since the last stamp."""
        self._charge(None)

    # ---- backward ----

    def backward_begin(self) -> None:
        """A backward begins: the head's runs first on the last stage."""
        self.stamp, self.open = self._now(), LAST if self.last else None

    def crossed(self, index: int) -> None:
        """The gradient reached the state before layer `index`: that layer's backward runs next
        (the embedding's below the first)."""
        below = self.layers[index - 1] if index > 0 else FIRST if self.first else None
        self._charge(below)

    def backward_end(self) -> None:
        self._charge(None)

    # ---- per step ----

    def collect(self) -> dict[int, float]:
        """Seconds per slot since the last `collect`."""
        if self.cuda and self.spans:
            self.spans[-1][2].synchronize()
        totals: dict[int, float] = {}
        for slot, start, end in self.spans:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals[slot] = totals.get(slot, 0.0) + seconds
        self.spans.clear()
        return totals


def job_share(totals: dict[int, float], layers: int, holders: int) -> tuple[float, ...]:
    """This rank's part of the job-wide costs vector (each layer, then first, then last), such
    that summed over the world it is the mean over the `holders` ranks that hold each part."""
    vector = [0.0] * (layers + 2)
    for slot, seconds in totals.items():
        vector[slot if slot >= 0 else layers + (0 if slot == FIRST else 1)] += seconds / holders
    return tuple(vector)
