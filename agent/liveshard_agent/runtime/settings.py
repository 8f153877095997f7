"""Training settings: the global batch, micro-batches, the schedule of the learning rate, the seed.

The global batch is fixed for the whole job: a layout's data-parallel degree only changes how many
micro-batches each replica runs (`micro_batches`). A layout whose global batch does not divide into
dp x micro-batch is rejected before any byte moves, with an error naming the numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from liveshard_core.errors import InvalidInput


@dataclass(frozen=True)
class TrainingSettings:
    """What a job trains with; identical on every member (part of every switch's agreement)."""

    global_batch: int = 24  # samples per step
    micro_batch: int = 2  # samples per micro-batch
    seq_len: int = 64  # tokens per sample
    steps: int = 100
    seed: int = 0
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    dropout: float = 0.0  # on each residual branch's output, from counter-based randomness
    aux_loss_coef: float = 0.01  # MoE load balancing
    data: str | None = None  # a file of bytes; None: the built-in corpus

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "seq_len", "steps"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidInput(f"training: {name}={value!r} must be an integer >= 1")
        if self.global_batch % self.micro_batch:
            raise InvalidInput(
                f"training: micro_batch={self.micro_batch} must divide "
                f"global_batch={self.global_batch}"
            )
        if not 0 <= self.dropout < 1:
            raise InvalidInput(f"training: dropout={self.dropout} must be in [0, 1)")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise InvalidInput(
                f"training: need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}) and lr > 0"
            )

    def micro_batches(self, dp: int) -> int:
        """Micro-batches each of `dp` replicas runs per step; InvalidInput if they do not divide."""
        per_step = dp * self.micro_batch
        if self.global_batch % per_step:
            raise InvalidInput(
                f"global batch {self.global_batch} does not divide into dp={dp} replicas x "
                f"micro-batches of {self.micro_batch} samples ({per_step} per round); choose a "
                f"dp that divides {self.global_batch // self.micro_batch}"
            )
        return self.global_batch // per_step

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to `min_lr` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(self.steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
