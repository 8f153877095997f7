"""Model specs: the ordered logical tensors of a decoder-only transformer and its training state.

A `TransformerConfig` (a preset or a user's JSON/YAML file) expands into a `ModelSpec`: the ordered
parameters with their global shapes, placement (layer, expert), tensor-parallel split dimension,
fused parts and tied aliases. Every parameter carries four logical tensors of training state under
mixed-precision Adam (`StateKind`): the low-precision parameter, its fp32 master copy and the two
Adam moments. This module owns the naming and ordering of that state; it must not know layouts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from math import prod
from pathlib import Path
from typing import Any

import yaml

from ..errors import InvalidInput


class DType(Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FP32 else 2


class StateKind(Enum):
    """One logical tensor of a parameter's training state. A model whose parameters are fp32 has
    no master copy: `ModelSpec.kinds` lists the kinds a model has."""

    PARAM = "param"
    MASTER = "master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"

    def zero_sharded(self, zero: int) -> bool:
        """Whether ZeRO stage `zero` shards this kind across the data-parallel group."""
        return zero >= 3 if self is StateKind.PARAM else zero >= 1


class Placement(Enum):
    """Which pipeline stage(s) hold a parameter."""

    FIRST = "first"  # the embedding: stage 0
    LAYER = "layer"  # the stage that holds `Param.layer`
    LAST = "last"  # final norm and lm_head: the last stage
    FIRST_AND_LAST = "first_and_last"  # a tied embedding, kept on both ends


@dataclass(frozen=True, slots=True)
class Param:
    """A model parameter as one logical tensor of global `shape`."""

    name: str
    shape: tuple[int, ...]
    placement: Placement
    layer: int | None = None
    expert: int | None = None
    split_dim: int | None = None  # the dimension tensor parallelism splits; None: replicated
    parts: tuple[int, ...] | None = None  # fused sizes along split_dim, each split separately
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied lm_head)

    def __post_init__(self) -> None:
        if (self.placement is Placement.LAYER) != (self.layer is not None):
            raise InvalidInput(
                f"{self.name}: a layer index is required exactly for LAYER placement"
            )
        if self.split_dim is not None and not 0 <= self.split_dim < len(self.shape):
            raise InvalidInput(
                f"{self.name}: split_dim {self.split_dim} outside shape {self.shape}"
            )
        if self.parts is not None and (
            self.split_dim is None or sum(self.parts) != self.shape[self.split_dim]
        ):
            raise InvalidInput(
                f"{self.name}: fused parts {self.parts} must sum to the split dimension"
            )


@dataclass(frozen=True, slots=True)
class TensorRef:
    """One logical tensor of training state: a parameter's `kind`."""

    param: int  # index into ModelSpec.params
    kind: StateKind


_POSITIVE = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn")
_POSITIVE_FLOATS = (
    "rope_theta", "norm_eps", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
)  # fmt: skip
_ROPE_TYPES = ("default", "llama3")
BOOLS = ("tied_embeddings", "qk_norm", "fused_qkv", "fused_gate_up", "qkv_bias", "o_bias",
         "norm_topk_prob")  # fmt: skip


@dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters that determine a decoder-only transformer's logical tensors."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 0  # 0: dense MLP; otherwise routed experts of size expert_ffn
    expert_ffn: int = 0
    tied_embeddings: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False  # one [q|k|v] tensor whose parts tp splits separately
    fused_gate_up: bool = False  # one [gate|up] tensor, likewise
    param_dtype: DType = DType.BF16
    top_k: int = 2  # experts each token is routed to (MoE only)
    rope_theta: float = 10000.0  # base of the rotary position frequencies
    norm_eps: float = 1e-6  # RMSNorm's epsilon
    qkv_bias: bool = False  # q, k and v projections with biases (Qwen2)
    o_bias: bool = False  # the output projection with a bias (Llama's attention_bias)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    # Llama 3's rotary frequency scaling ("default": none): the factor, the low and high
    # frequency factors and the context length the model was trained with.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 0
    sliding_window: int = 0  # attention window in tokens; 0: none (every sequence fits)

    def __post_init__(self) -> None:
        for field in _POSITIVE:
            value = getattr(self, field)
            if type(value) is not int or value < 1:
                raise InvalidInput(
                    f"model {self.name!r}: {field}={value!r} must be an integer >= 1"
                )
        for field in ("experts", "expert_ffn"):
            value = getattr(self, field)
            if type(value) is not int or value < 0:
                raise InvalidInput(
                    f"model {self.name!r}: {field}={value!r} must be an integer >= 0"
                )
        if self.heads % self.kv_heads:
            raise InvalidInput(
                f"model {self.name!r}: kv_heads={self.kv_heads} must divide heads={self.heads}"
            )
        if (self.experts == 0) != (self.expert_ffn == 0):
            raise InvalidInput(
                f"model {self.name!r}: experts={self.experts} and expert_ffn={self.expert_ffn} "
                "must both be 0 (dense) or both >= 1 (MoE)"
            )
        if type(self.top_k) is not int or self.top_k < 1 or self.top_k > (self.experts or 1 << 30):
            raise InvalidInput(
                f"model {self.name!r}: top_k={self.top_k!r} must be an integer between 1 and "
                f"the number of experts ({self.experts})"
            )
        for field in _POSITIVE_FLOATS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidInput(f"model {self.name!r}: {field}={value!r} must be > 0")
        if self.rope_type not in _ROPE_TYPES:
            raise InvalidInput(
                f"model {self.name!r}: rope_type={self.rope_type!r} must be one of {_ROPE_TYPES}"
            )
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        if self.rope_type == "llama3" and (self.rope_original_positions < 1 or high <= low):
            raise InvalidInput(
                f"model {self.name!r}: llama3 rope scaling needs rope_original_positions >= 1 "
                f"and rope_high_freq_factor > rope_low_freq_factor"
            )
        if type(self.sliding_window) is not int or self.sliding_window < 0:
            raise InvalidInput(
                f"model {self.name!r}: sliding_window={self.sliding_window!r} must be an "
                "integer >= 0"
            )


def _attention(cfg: TransformerConfig, layer: int) -> list[Param]:
    def p(name: str, shape: tuple[int, ...], split: int | None, **kw: Any) -> Param:
        return Param(
            f"layers.{layer}.attn.{name}", shape, Placement.LAYER, layer, None, split, **kw
        )

    q, kv, h = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden
    out = [p("norm", (h,), None)]
    if cfg.fused_qkv:
        out.append(p("qkv", (q + 2 * kv, h), 0, parts=(q, kv, kv)))
    else:
        out += [p("q", (q, h), 0), p("k", (kv, h), 0), p("v", (kv, h), 0)]
    if cfg.qkv_bias and cfg.fused_qkv:
        out.append(p("qkv_bias", (q + 2 * kv,), 0, parts=(q, kv, kv)))
    elif cfg.qkv_bias:
        out += [p("q_bias", (q,), 0), p("k_bias", (kv,), 0), p("v_bias", (kv,), 0)]
    out.append(p("o", (h, q), 1))
    if cfg.o_bias:
        out.append(p("o_bias", (h,), None))
    if cfg.qk_norm:
        out += [p("q_norm", (cfg.head_dim,), None), p("k_norm", (cfg.head_dim,), None)]
    return out


def _mlp(
    cfg: TransformerConfig, layer: int, prefix: str, ffn: int, expert: int | None
) -> list[Param]:
    def p(name: str, shape: tuple[int, ...], split: int, **kw: Any) -> Param:
        return Param(f"{prefix}.{name}", shape, Placement.LAYER, layer, expert, split, **kw)

    h = cfg.hidden
    if cfg.fused_gate_up:
        up = [p("gate_up", (2 * ffn, h), 0, parts=(ffn, ffn))]
    else:
        up = [p("gate", (ffn, h), 0), p("up", (ffn, h), 0)]
    return [*up, p("down", (h, ffn), 1)]


def _params(cfg: TransformerConfig) -> list[Param]:
    h = cfg.hidden
    embed_place = Placement.FIRST_AND_LAST if cfg.tied_embeddings else Placement.FIRST
    aliases = ("lm_head",) if cfg.tied_embeddings else ()
    out = [Param("embed", (cfg.vocab, h), embed_place, split_dim=0, aliases=aliases)]
    for layer in range(cfg.layers):
        out += _attention(cfg, layer)
        out.append(Param(f"layers.{layer}.mlp.norm", (h,), Placement.LAYER, layer))
        if cfg.experts:
            out.append(
                Param(f"layers.{layer}.mlp.router", (cfg.experts, h), Placement.LAYER, layer)
            )
            for e in range(cfg.experts):
                out += _mlp(cfg, layer, f"layers.{layer}.mlp.experts.{e}", cfg.expert_ffn, e)
        else:
            out += _mlp(cfg, layer, f"layers.{layer}.mlp", cfg.ffn, None)
    out.append(Param("final_norm", (h,), Placement.LAST))
    if not cfg.tied_embeddings:
        out.append(Param("lm_head", (cfg.vocab, h), Placement.LAST, split_dim=0))
    return out


Ints = tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """The ordered logical tensors of a model; the order is part of every plan's identity."""

    config: TransformerConfig
    params: tuple[Param, ...]

    @classmethod
    def from_config(cls, config: TransformerConfig) -> ModelSpec:
        return cls(config, tuple(_params(config)))

    @cached_property
    def kinds(self) -> tuple[StateKind, ...]:
        """The state kinds of every parameter: an fp32 model keeps no separate master copy."""
        if self.config.param_dtype is DType.FP32:
            return tuple(k for k in StateKind if k is not StateKind.MASTER)
        return tuple(StateKind)

    def dtype(self, kind: StateKind) -> DType:
        return self.config.param_dtype if kind is StateKind.PARAM else DType.FP32

    def tensor_name(self, ref: TensorRef) -> str:
        name = self.params[ref.param].name
        return name if ref.kind is StateKind.PARAM else f"{name}:{ref.kind.value}"

    def tensors(self) -> list[TensorRef]:
        """Every logical tensor of training state, in canonical order."""
        return [TensorRef(i, kind) for i in range(len(self.params)) for kind in self.kinds]

    @cached_property
    def _refs(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.params)} | {
            alias: i for i, p in enumerate(self.params) for alias in p.aliases
        }

    def ref(self, name: str, kind: StateKind = StateKind.PARAM) -> TensorRef:
        """The logical tensor `kind` of the parameter called `name` (or one of its aliases)."""
        if name not in self._refs:
            raise InvalidInput(f"model {self.config.name!r} has no parameter {name!r}")
        if kind not in self.kinds:
            raise InvalidInput(
                f"model {self.config.name!r} keeps no {kind.value} state "
                f"({self.config.param_dtype.value} parameters); kinds: "
                f"{[k.value for k in self.kinds]}"
            )
        return TensorRef(self._refs[name], kind)

    @cached_property
    def signatures(self) -> tuple[Ints, Ints, Ints, Ints]:
        """Per parameter: the number of its (shape, split dimension, parts) among the model's
        distinct ones, its placement, its layer (-1: none) and its expert (-1: none)."""
        numbers: dict[tuple[object, ...], int] = {}
        shapes = tuple(
            numbers.setdefault((p.shape, p.split_dim, p.parts), len(numbers)) for p in self.params
        )
        order = {placement: i for i, placement in enumerate(Placement)}
        placements = tuple(order[p.placement] for p in self.params)
        layers = tuple(-1 if p.layer is None else p.layer for p in self.params)
        experts = tuple(-1 if p.expert is None else p.expert for p in self.params)
        return shapes, placements, layers, experts

    @cached_property
    def digest(self) -> str:
        """A short hash of the config: equal digests mean equal logical tensors."""
        text = json.dumps(config_to_dict(self.config), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @cached_property
    def state_bytes(self) -> int:
        """Bytes of all training state held once (no replication)."""
        per_elem = sum(self.dtype(k).itemsize for k in self.kinds)
        return sum(prod(p.shape) for p in self.params) * per_elem


def config_to_dict(config: TransformerConfig) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    out["param_dtype"] = config.param_dtype.value
    return out


def config_from_dict(data: Any, source: str) -> TransformerConfig:
    """Validate a user-supplied mapping into a config; errors name the field and what is valid."""
    if not isinstance(data, dict):
        raise InvalidInput(
            f"{source}: expected a mapping of model fields, got {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(str(key) for key in set(data) - set(fields))
    if unknown:
        raise InvalidInput(f"{source}: unknown field(s) {unknown}; valid fields: {sorted(fields)}")
    missing = sorted(
        n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data
    )
    if missing:
        raise InvalidInput(f"{source}: missing required field(s) {missing}")
    values = dict(data)
    for name in BOOLS:
        if name in values and not isinstance(values[name], bool):
            raise InvalidInput(f"{source}: {name}={values[name]!r} must be true or false")
    if not isinstance(values["name"], str) or not values["name"]:
        raise InvalidInput(f"{source}: name={values['name']!r} must be a non-empty string")
    for name in _POSITIVE_FLOATS:
        if isinstance(values.get(name), int) and not isinstance(values[name], bool):
            values[name] = float(values[name])  # JSON and YAML may drop the ".0"
    if "param_dtype" in values:
        valid = [d.value for d in DType]
        if values["param_dtype"] not in valid:
            raise InvalidInput(
                f"{source}: param_dtype={values['param_dtype']!r} must be one of {valid}"
            )
        values["param_dtype"] = DType(values["param_dtype"])
    try:
        return TransformerConfig(**values)
    except ValueError as err:
        raise InvalidInput(f"{source}: {err}") from None


def load_spec_file(path: Path) -> ModelSpec:
    """Read a model config from a JSON or YAML file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise InvalidInput(f"cannot read model file {path}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as err:
        raise InvalidInput(f"{path}: not valid JSON or YAML: {err}") from None
    return ModelSpec.from_config(config_from_dict(data, str(path)))
