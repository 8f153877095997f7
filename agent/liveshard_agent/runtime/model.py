"""The decoder-only transformer, one pipeline stage of it on one rank, computing with the
weights of the engine's sharded state.

RMSNorm, attention with grouped KV heads, optional q/k/v and output biases, rotary positions in
Hugging Face's convention (the two halves of each head rotated; llama3 frequency scaling where the
config has it) and (where the spec has it) q/k norms, a SwiGLU MLP or a mixture of experts (`moe`),
tied or untied embeddings: the math of the Hugging Face architectures liveshard loads. Tensor
parallelism is Megatron's: column-parallel q, k, v (each part of a fused qkv split on its own),
gate and up; row-parallel o and down; a vocabulary-parallel embedding and cross-entropy.
Activations between layers are replicated across tp. Dropout, when on, masks each residual
branch's output with counter-based randomness keyed by (seed, step, sample, layer, position,
feature), so the mask of a sample does not depend on the layout. The layers frozen at a step
(`TrainingSettings.freeze`) compute with detached weights, and so does the input embedding's
lookup once any layer is frozen: no gradient reaches them and autograd saves nothing for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from liveshard_core.job import TrainingSettings
from liveshard_core.vps.spec import ModelSpec, TransformerConfig

from ..engine.backend import Group
from ..engine.world import Axis
from . import comm, rng
from .costs import LayerClock
from .data import Batch
from .moe import moe_forward
from .weights import Weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().square().mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rotary_frequencies(cfg: TransformerConfig) -> torch.Tensor:
    """The inverse frequencies of the rotary embedding (float32, as transformers computes
    them), with llama3's scaling when the config has it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_type != "llama3":
        return inv
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_positions
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def dropout_keep(
    key: int, step: int, layer: int, samples: torch.Tensor, seq: int, features: int, p: float
) -> torch.Tensor:
    """Which elements dropout keeps, [samples, seq, features], for the given global sample
    indices: a function of (key, step, layer, sample, position, feature) only."""
    base = rng.key(key, step, layer)
    index = (
        samples.view(-1, 1, 1),
        torch.arange(seq).view(1, -1, 1),
        torch.arange(features).view(1, 1, -1),
    )
    return rng.uniform(base, *index) >= p


@dataclass
class Output:
    """What a stage's forward returns: the hidden state for the next stage, or (last stage) the
    sum of the tokens' cross-entropy and the MoE auxiliary loss, both unnormalised."""

    hidden: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    aux: torch.Tensor | None = None


class StageModel:
    """This rank's stage: its layers, and the embedding and head if it holds them."""

    def __init__(self, weights: Weights, settings: TrainingSettings) -> None:
        self.weights = weights
        self.settings = settings
        self.spec: ModelSpec = weights.spec
        self.cfg = weights.spec.config
        layout, rank = weights.layout, weights.rank
        pp_i, _, _ = layout.coords(rank)
        self.first, self.last = pp_i == 0, pp_i == layout.pp - 1
        start = sum(layout.pp_layers[:pp_i])
        self.layers = range(start, start + layout.pp_layers[pp_i])
        self.dropout_key = rng.key("dropout", settings.seed)
        self.frozen = 0  # the first layers frozen at the step of the running forward
        self.clock = LayerClock(self.layers, self.first, self.last, weights.state.device)

    @property
    def tp(self) -> Group:
        """Looked up at each use: a broken world's groups are dropped to close them."""
        return self.weights.world.group(Axis.TP)

    @cached_property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [seq_len, head_dim], each half of a head's dimensions at one frequency."""
        inv = rotary_frequencies(self.cfg)
        angles = torch.outer(torch.arange(self.settings.seq_len, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        device = self.weights.state.device
        return angles.cos().to(device), angles.sin().to(device)

    def forward(self, batch: Batch, hidden: torch.Tensor | None, step: int) -> Output:
        """The stage's forward of one micro-batch, its layers timed by `clock`."""
        self.frozen = self.settings.frozen_layers(step)
        clock = self.clock
        clock.begin()
        if self.first:
            x = self._embed(batch.inputs)
        else:
            assert hidden is not None
            x = hidden
        aux = torch.zeros((), device=x.device)
        for i, layer in enumerate(self.layers):
            x = clock.boundary(x, i)
            x = x + self._dropout(self._attention(layer, x), batch, step, 2 * layer)
            mlp, layer_aux = self._mlp(layer, x)
            aux = aux + layer_aux
            x = x + self._dropout(mlp, batch, step, 2 * layer + 1)
        x = clock.boundary(x, len(self.layers))
        out = Output(hidden=x, aux=aux)
        if self.last:
            out = Output(loss_sum=self._loss(x, batch.targets), aux=aux)
        clock.end()
        return out

    # ---- pieces ----

    def tensors(self, name: str) -> list[torch.Tensor]:
        """What the stage computes with for weight `name`: its tensors, detached where its layer
        is frozen in this forward (no gradient reaches them)."""
        weight = self.weights[name]
        layer = weight.param.layer
        if layer is not None and layer < self.frozen:
            return [t.detach() for t in weight.tensors]
        return weight.tensors

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weights["embed"]
        (start, stop), _ = weight.boxes[0]
        local = tokens - start
        mine = (local >= 0) & (local < stop - start)
        # The input embedding freezes with the first layer; tied, it still trains through the head.
        table = weight.tensors[0].detach() if self.frozen >= 1 else weight.tensors[0]
        x = F.embedding(local.clamp(0, stop - start - 1), table) * mine.unsqueeze(-1)
        return comm.reduce_from(x, self.tp)

    def _attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        prefix = f"layers.{layer}.attn."
        h = comm.copy_to(self._norm(x, prefix + "norm"), self.tp)
        d = self.cfg.head_dim
        batch, seq = x.shape[:2]
        q, k, v = (p.view(batch, seq, -1, d) for p in self._qkv(prefix, h))
        if self.cfg.qk_norm:
            q, k = self._norm(q, prefix + "q_norm"), self._norm(k, prefix + "k_norm")
        q, k = self._rotate(q), self._rotate(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        out = comm.reduce_from(out @ self.tensors(prefix + "o")[0].T, self.tp)
        return out + self.tensors(prefix + "o_bias")[0] if self.cfg.o_bias else out

    def _qkv(self, prefix: str, h: torch.Tensor) -> list[torch.Tensor]:
        """This rank's q, k and v projections of `h`, biased where the model has biases."""
        if self.cfg.fused_qkv:
            weights = self.tensors(prefix + "qkv")
            biases = self.tensors(prefix + "qkv_bias") if self.cfg.qkv_bias else None
        else:
            weights = [self.tensors(prefix + n)[0] for n in ("q", "k", "v")]
            biases = ([self.tensors(prefix + n)[0] for n in ("q_bias", "k_bias", "v_bias")]
                      if self.cfg.qkv_bias else None)  # fmt: skip
        if biases is None:
            return [h @ w.T for w in weights]
        return [h @ w.T + b for w, b in zip(weights, biases, strict=True)]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.tensors(name)[0], self.cfg.norm_eps)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotary positions on [batch, seq, heads, head_dim]: Hugging Face's rotate-half."""
        cos, sin = self.rope
        seq = x.shape[1]
        cos, sin = cos[:seq, None, :], sin[:seq, None, :]
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return (x.float() * cos + rotated * sin).to(x.dtype)

    def _mlp(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"layers.{layer}.mlp."
        h = self._norm(x, prefix + "norm")
        if self.cfg.experts:
            return moe_forward(self, layer, h)
        return self.swiglu(prefix, comm.copy_to(h, self.tp)), torch.zeros((), device=x.device)

    def swiglu(self, prefix: str, h: torch.Tensor) -> torch.Tensor:
        """A SwiGLU MLP (dense, or one expert) on input `h` already copied to the tp group."""
        if self.cfg.fused_gate_up:
            gate, up = self.tensors(prefix + "gate_up")
        else:
            (gate,), (up,) = self.tensors(prefix + "gate"), self.tensors(prefix + "up")
        inner = F.silu(h @ gate.T) * (h @ up.T)
        return comm.reduce_from(inner @ self.tensors(prefix + "down")[0].T, self.tp)

    def _dropout(self, x: torch.Tensor, batch: Batch, step: int, layer: int) -> torch.Tensor:
        p = self.settings.dropout
        if p == 0:
            return x
        keep = dropout_keep(self.dropout_key, step, layer, batch.samples, x.shape[1], x.shape[2], p)
        return x * keep.to(device=x.device, dtype=x.dtype) / (1 - p)

    def _loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = comm.copy_to(self._norm(x, "final_norm"), self.tp)
        head = self.weights["lm_head" if "lm_head" in self.weights else "embed"]
        (start, _), _ = head.boxes[0]
        logits = x.reshape(-1, x.shape[-1]) @ head.tensors[0].T
        return comm.vocab_parallel_cross_entropy(logits, targets.reshape(-1), start, self.tp).sum()
