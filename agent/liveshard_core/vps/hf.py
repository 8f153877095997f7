"""Hugging Face model directories: their `config.json` read into a `TransformerConfig`, and the one
table from Hugging Face tensor names onto the logical tensors.

Architectures: `LlamaForCausalLM` (llama3 rope scaling included), `MistralForCausalLM`,
`Qwen2ForCausalLM` (q/k/v biases), `Qwen3ForCausalLM` (q/k norms), `Qwen3MoeForCausalLM` and
`MixtralForCausalLM`, with configs as transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`) write them. A field that changes the math and that liveshard cannot compute
exactly is refused with an error naming it, never approximated.

The table (`sources`) says, for each logical parameter, which Hugging Face tensors fill it: a
fused `qkv` or `gate_up` is the concatenation of its parts along its split dimension, so each
part is a `Source` covering a slice of the logical tensor. Loading and export both read it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidInput
from .spec import ModelSpec, TransformerConfig

ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM",
)  # fmt: skip
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# Logical name within a layer -> the Hugging Face name within `model.layers.{i}.`.
_LAYER = {
    "attn.norm": "input_layernorm.weight",
    "attn.q": "self_attn.q_proj.weight",
    "attn.k": "self_attn.k_proj.weight",
    "attn.v": "self_attn.v_proj.weight",
    "attn.q_bias": "self_attn.q_proj.bias",
    "attn.k_bias": "self_attn.k_proj.bias",
    "attn.v_bias": "self_attn.v_proj.bias",
    "attn.o": "self_attn.o_proj.weight",
    "attn.o_bias": "self_attn.o_proj.bias",
    "attn.q_norm": "self_attn.q_norm.weight",
    "attn.k_norm": "self_attn.k_norm.weight",
    "mlp.norm": "post_attention_layernorm.weight",
    "mlp.gate": "mlp.gate_proj.weight",
    "mlp.up": "mlp.up_proj.weight",
    "mlp.down": "mlp.down_proj.weight",
}
# How each MoE family names its router and its experts' projections.
_MOE = {
    "Qwen3MoeForCausalLM": (
        "mlp.gate.weight", "mlp.experts.{e}.{w}_proj.weight",
        {"gate": "gate", "up": "up", "down": "down"},
    ),
    "MixtralForCausalLM": (
        "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.{w}.weight",
        {"gate": "w1", "up": "w3", "down": "w2"},
    ),
}  # fmt: skip
# Families whose every layer honours `sliding_window` when set.
_SLIDING = ("MistralForCausalLM", "MixtralForCausalLM")
_FUSED = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"),
          "gate_up": ("gate", "up")}  # fmt: skip
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)")


@dataclass(frozen=True)
class Source:
    """The Hugging Face tensor `name` is the logical parameter's slice `[start, stop)` along
    `dim` (the whole parameter when it is not fused)."""

    name: str
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class HfModel:
    """A Hugging Face model directory: its config as read and as liveshard's."""

    directory: Path
    architecture: str
    raw: dict[str, Any]  # config.json as read; an export writes it back
    config: TransformerConfig

    @classmethod
    def load(cls, directory: str | Path) -> HfModel:
        """Read `directory/config.json` (q/k/v and gate/up kept fused, one tensor each)."""
        path = Path(directory)
        raw = read_json(path / "config.json")
        arch = architecture(raw, str(path / "config.json"))
        config = from_hf(raw, arch, path.name or str(path), str(path / "config.json"))
        return cls(path, arch, raw, config)

    @property
    def has_weights(self) -> bool:
        return (self.directory / WEIGHTS).exists() or (self.directory / WEIGHTS_INDEX).exists()

    def weight_files(self) -> dict[str, Path]:
        """Each Hugging Face tensor name -> the safetensors file that holds it."""
        index = self.directory / WEIGHTS_INDEX
        if index.exists():
            data = read_json(index)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict):
                raise InvalidInput(f"{index}: no weight_map")
            return {name: self.directory / file for name, file in weight_map.items()}
        if not (self.directory / WEIGHTS).exists():
            raise InvalidInput(
                f"{self.directory}: no {WEIGHTS} or {WEIGHTS_INDEX} (use init random to start "
                "from a fresh initialisation)"
            )
        return {}  # one file: names are read from it

    def sources(self, spec: ModelSpec) -> list[list[Source]]:
        """Per logical parameter of `spec`, the Hugging Face tensors that fill it."""
        return [
            [
                Source(self.hf_name(name), p.split_dim or 0, start, stop)
                for name, start, stop in _parts(p.name, p.shape, p.split_dim, p.parts)
            ]
            for p in spec.params
        ]

    def hf_name(self, logical: str) -> str:
        """The Hugging Face name of an unfused logical parameter."""
        if logical == "embed":
            return "model.embed_tokens.weight"
        if logical == "final_norm":
            return "model.norm.weight"
        if logical == "lm_head":
            return "lm_head.weight"
        _, layer, rest = logical.split(".", 2)
        prefix = f"model.layers.{layer}."
        if rest in _LAYER:
            return prefix + _LAYER[rest]
        router, expert, names = _MOE[self.architecture]
        if rest == "mlp.router":
            return prefix + router
        match = _EXPERT.fullmatch(rest)
        if match is None:
            raise InvalidInput(f"{logical}: no Hugging Face name in {self.architecture}")
        return prefix + expert.format(e=match[1], w=names[match[2]])


def _parts(
    name: str, shape: tuple[int, ...], dim: int | None, parts: tuple[int, ...] | None
) -> list[tuple[str, int, int]]:
    """(unfused logical name, start, stop) of each part of a parameter."""
    head, _, last = name.rpartition(".")
    if parts is None or last not in _FUSED:
        return [(name, 0, shape[dim or 0])]
    out, start = [], 0
    for part, size in zip(_FUSED[last], parts, strict=True):
        out.append((f"{head}.{part}", start, start + size))
        start += size
    return out


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise InvalidInput(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise InvalidInput(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a JSON object")
    return data


def architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise InvalidInput(
            f"{source}: architectures={archs!r}: liveshard trains exactly one of "
            f"{list(ARCHITECTURES)}"
        )
    return str(archs[0])


def from_hf(raw: dict[str, Any], arch: str, name: str, source: str) -> TransformerConfig:
    """`config.json` as liveshard's config; refuses what it cannot compute exactly."""

    def get(key: str, default: Any = None) -> Any:
        value = raw.get(key, default)
        return default if value is None else value

    def refuse(key: str, why: str) -> InvalidInput:
        return InvalidInput(f"{source}: {key}={raw.get(key)!r}: {why}")

    if get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "liveshard computes SwiGLU MLPs with silu only")
    if get("attention_dropout", 0.0) != 0.0:
        raise refuse("attention_dropout", "attention dropout is not computed (set it to 0)")
    if get("mlp_bias", False):
        raise refuse("mlp_bias", "MLP biases are not supported")
    layer_types = get("layer_types", [])
    if get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise refuse(
            "use_sliding_window" if get("use_sliding_window", False) else "layer_types",
            "per-layer sliding-window attention is not computed",
        )
    hidden, heads = _need(raw, source, "hidden_size"), _need(raw, source, "num_attention_heads")
    moe = arch in _MOE
    values: dict[str, Any] = dict(
        name=name,
        vocab=_need(raw, source, "vocab_size"),
        hidden=hidden,
        layers=_need(raw, source, "num_hidden_layers"),
        heads=heads,
        kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim", hidden // heads)),
        ffn=_need(raw, source, "intermediate_size"),
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        fused_qkv=True,
        fused_gate_up=True,
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(get("attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(get("attention_bias", False)),
        sliding_window=int(get("sliding_window", 0)) if arch in _SLIDING else 0,
        **_rope(raw, source),
    )
    if moe:
        values.update(_experts(raw, arch, source))
    try:
        return TransformerConfig(**values)
    except InvalidInput as err:
        raise InvalidInput(f"{source}: {err}") from None


def _need(raw: dict[str, Any], source: str, *keys: str) -> int:
    """The first of `keys` the config has, as an integer."""
    for key in keys:
        if raw.get(key) is not None:
            return int(raw[key])
    raise InvalidInput(f"{source}: {' or '.join(keys)} is required")


def _experts(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    if arch == "MixtralForCausalLM":
        if raw.get("router_jitter_noise"):
            raise InvalidInput(
                f"{source}: router_jitter_noise={raw['router_jitter_noise']!r}: router noise "
                "is not computed (set it to 0)"
            )
        return dict(experts=_need(raw, source, "num_local_experts"),
                    expert_ffn=_need(raw, source, "intermediate_size"),
                    top_k=_need(raw, source, "num_experts_per_tok"),
                    norm_topk_prob=True)  # fmt: skip
    if raw.get("mlp_only_layers"):
        raise InvalidInput(
            f"{source}: mlp_only_layers={raw['mlp_only_layers']!r}: every layer must be MoE"
        )
    if int(raw.get("decoder_sparse_step", 1)) != 1:
        raise InvalidInput(
            f"{source}: decoder_sparse_step={raw['decoder_sparse_step']!r}: every layer must "
            "be MoE (1)"
        )
    if raw.get("shared_expert_intermediate_size"):
        raise InvalidInput(f"{source}: shared experts are not supported")
    return dict(experts=_need(raw, source, "num_experts", "num_local_experts"),
                expert_ffn=_need(raw, source, "moe_intermediate_size"),
                top_k=_need(raw, source, "num_experts_per_tok"),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))  # fmt: skip


def _rope(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The rotary settings of transformers 5's `rope_parameters` or 4's `rope_theta` +
    `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise InvalidInput(f"{source}: rope_parameters={params!r} must be an object")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": kind}
    if kind == "default":
        return out
    if kind != "llama3":
        raise InvalidInput(
            f"{source}: rope_type={kind!r}: liveshard computes default and llama3 rotary "
            "frequencies only"
        )
    try:
        return out | {
            "rope_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_positions": int(params["original_max_position_embeddings"]),
        }
    except KeyError as err:
        raise InvalidInput(f"{source}: llama3 rope scaling without {err.args[0]}") from None
