"""Model specs: preset shapes, tensor-parallel structure, and user model files."""

from __future__ import annotations

import json
from math import prod
from pathlib import Path
from typing import Any

import pytest

from liveshard_core.vps.presets import CONFIGS, preset, resolve_model
from liveshard_core.vps.spec import (
    DType,
    ModelSpec,
    Param,
    Placement,
    StateKind,
    TensorRef,
    TransformerConfig,
    config_from_dict,
    load_spec_file,
)


def shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {p.name: p.shape for p in spec.params}


def by_name(spec: ModelSpec) -> dict[str, Param]:
    return {p.name: p for p in spec.params}


def numel(spec: ModelSpec) -> int:
    return sum(prod(p.shape) for p in spec.params)


def test_llama_70b_shapes() -> None:
    spec = preset("llama-70b")
    got = shapes(spec)
    assert len(got) == len(spec.params)  # names are unique
    assert got["embed"] == (32000, 8192)
    assert got["lm_head"] == (32000, 8192)
    assert got["final_norm"] == (8192,)
    for layer in (0, 41, 79):
        a, m = f"layers.{layer}.attn", f"layers.{layer}.mlp"
        assert got[f"{a}.norm"] == (8192,)
        assert got[f"{a}.q"] == (8192, 8192)
        assert got[f"{a}.k"] == (1024, 8192)
        assert got[f"{a}.v"] == (1024, 8192)
        assert got[f"{a}.o"] == (8192, 8192)
        assert got[f"{m}.norm"] == (8192,)
        assert got[f"{m}.gate"] == (28672, 8192)
        assert got[f"{m}.up"] == (28672, 8192)
        assert got[f"{m}.down"] == (8192, 28672)
    assert "layers.80.attn.q" not in got
    assert {p.layer for p in spec.params if p.layer is not None} == set(range(80))
    # Per layer: 9 tensors (2 norms, q, k, v, o, gate, up, down); plus embed, final_norm, lm_head.
    assert len(spec.params) == 80 * 9 + 3
    # Per layer: q + o = 2 * 8192^2, k + v = 2 * 1024 * 8192, 3 * 28672 * 8192 MLP, 2 norms.
    per_layer = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192 + 2 * 8192
    total = 80 * per_layer + 2 * 32000 * 8192 + 8192
    assert numel(spec) == total
    assert 68.9e9 < total < 69.0e9  # the published ~69B
    assert spec.state_bytes == total * (2 + 3 * 4)  # bf16 param + fp32 master and two moments


def test_qwen3_235b_shapes() -> None:
    spec = preset("qwen3-235b-a22b")
    got = shapes(spec)
    assert got["embed"] == (151936, 4096)
    assert got["lm_head"] == (151936, 4096)
    assert got["final_norm"] == (4096,)
    for layer in (0, 93):
        a, m = f"layers.{layer}.attn", f"layers.{layer}.mlp"
        assert got[f"{a}.norm"] == (4096,)
        assert got[f"{a}.q"] == (8192, 4096)
        assert got[f"{a}.k"] == (512, 4096)
        assert got[f"{a}.v"] == (512, 4096)
        assert got[f"{a}.o"] == (4096, 8192)
        assert got[f"{a}.q_norm"] == (128,)
        assert got[f"{a}.k_norm"] == (128,)
        assert got[f"{m}.norm"] == (4096,)
        assert got[f"{m}.router"] == (128, 4096)
        for e in (0, 127):
            assert got[f"{m}.experts.{e}.gate"] == (1536, 4096)
            assert got[f"{m}.experts.{e}.up"] == (1536, 4096)
            assert got[f"{m}.experts.{e}.down"] == (4096, 1536)
        assert f"{m}.experts.128.gate" not in got
        assert f"{m}.gate" not in got  # no dense MLP in a MoE layer
    assert {p.layer for p in spec.params if p.layer is not None} == set(range(94))
    experts = {p.expert for p in spec.params if p.expert is not None}
    assert experts == set(range(128))
    # Per layer: 2 norms, q, k, v, o, q_norm, k_norm, router, and 3 tensors per expert.
    assert len(spec.params) == 94 * (9 + 3 * 128) + 3
    per_layer = (
        2 * 4096  # attn.norm, mlp.norm
        + 8192 * 4096 * 2  # q, o
        + 512 * 4096 * 2  # k, v
        + 2 * 128  # q_norm, k_norm
        + 128 * 4096  # router
        + 128 * 3 * 1536 * 4096  # experts
    )
    total = 94 * per_layer + 2 * 151936 * 4096 + 4096
    assert numel(spec) == total
    assert 234e9 < total < 236e9  # the published 235B


def test_tiny_structure() -> None:
    spec = preset("tiny")
    p = by_name(spec)
    # q = 4 heads * 16 = 64 rows, kv = 2 * 16 = 32 rows each.
    assert p["layers.0.attn.qkv"].shape == (128, 64)
    assert p["layers.0.attn.qkv"].parts == (64, 32, 32)
    assert p["layers.0.mlp.gate_up"].shape == (384, 64)
    assert p["layers.0.mlp.gate_up"].parts == (192, 192)
    assert p["layers.0.mlp.down"].shape == (64, 192)
    assert p["embed"].placement is Placement.FIRST_AND_LAST
    assert p["embed"].aliases == ("lm_head",)
    assert "lm_head" not in p  # tied: one tensor
    assert "layers.0.attn.q" not in p
    # embed 256*64; per layer 2 norms of 64, qkv 128*64, o 64*64, gate_up 384*64, down 64*192.
    per_layer = 2 * 64 + 128 * 64 + 64 * 64 + 384 * 64 + 64 * 192  # = 49280
    assert numel(spec) == 256 * 64 + 4 * per_layer + 64 == 213568
    assert spec.state_bytes == 213568 * 14


def test_tiny_moe_structure() -> None:
    spec = preset("tiny-moe")
    p = by_name(spec)
    assert p["embed"].placement is Placement.FIRST
    assert p["lm_head"].placement is Placement.LAST
    assert p["lm_head"].split_dim == 0
    assert p["layers.2.mlp.router"].shape == (8, 64)
    assert p["layers.2.mlp.router"].split_dim is None
    assert p["layers.2.mlp.experts.5.down"].shape == (64, 48)
    assert p["layers.2.mlp.experts.5.down"].expert == 5
    assert p["layers.2.mlp.experts.5.down"].layer == 2
    assert p["layers.2.attn.q_norm"].shape == (16,)
    # per layer: norms 2*64, q 64*64, k,v 32*64 each, o 64*64, q/k_norm 16 each, router 8*64,
    # experts 8 * 3 * 48*64.
    per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16 + 8 * 64 + 8 * 3 * 48 * 64
    assert numel(spec) == 4 * per_layer + 2 * 256 * 64 + 64


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp_split_conventions(name: str) -> None:
    spec = preset(name)
    for p in spec.params:
        last = p.name.rsplit(".", 1)[-1]
        if last in ("q", "k", "v", "qkv", "gate", "up", "gate_up") or p.name in (
            "embed",
            "lm_head",
        ):
            assert p.split_dim == 0, p.name
        elif last in ("o", "down"):
            assert p.split_dim == 1, p.name
        else:
            assert last in ("norm", "final_norm", "router", "q_norm", "k_norm"), p.name
            assert p.split_dim is None, p.name
        assert (p.placement is Placement.LAYER) == (p.layer is not None)


def test_tensors_order_names_and_dtypes() -> None:
    spec = preset("tiny")
    refs = spec.tensors()
    assert len(refs) == 4 * len(spec.params)
    assert refs[:5] == [
        TensorRef(0, StateKind.PARAM),
        TensorRef(0, StateKind.MASTER),
        TensorRef(0, StateKind.EXP_AVG),
        TensorRef(0, StateKind.EXP_AVG_SQ),
        TensorRef(1, StateKind.PARAM),
    ]
    assert spec.tensor_name(refs[0]) == "embed"
    assert spec.tensor_name(refs[3]) == "embed:exp_avg_sq"
    assert spec.dtype(StateKind.PARAM) is DType.BF16
    assert spec.dtype(StateKind.EXP_AVG) is DType.FP32
    assert DType.BF16.itemsize == DType.FP16.itemsize == 2
    assert DType.FP32.itemsize == 4


def test_zero_sharded_by_stage() -> None:
    assert not StateKind.PARAM.zero_sharded(0)
    assert not StateKind.PARAM.zero_sharded(1)
    assert StateKind.PARAM.zero_sharded(3)
    for kind in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
        assert not kind.zero_sharded(0)
        assert kind.zero_sharded(1)
        assert kind.zero_sharded(3)


def test_param_validation() -> None:
    with pytest.raises(ValueError, match="layer index"):
        Param("x", (4,), Placement.LAYER)
    with pytest.raises(ValueError, match="split_dim"):
        Param("x", (4,), Placement.FIRST, split_dim=1)
    with pytest.raises(ValueError, match="fused parts"):
        Param("x", (4, 2), Placement.FIRST, split_dim=0, parts=(1, 2))


def test_spec_digest_depends_on_config() -> None:
    a = ModelSpec.from_config(CONFIGS["tiny"])
    assert a.digest == preset("tiny").digest
    assert a.digest != preset("tiny-moe").digest


# --- user model files -------------------------------------------------------------------------

VALID: dict[str, Any] = {
    "name": "mine",
    "vocab": 32,
    "hidden": 8,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 2,
    "ffn": 12,
}


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**VALID, "fused_qkv": True, "param_dtype": "fp16"}))
    spec = load_spec_file(path)
    assert spec.config == TransformerConfig(**VALID, fused_qkv=True, param_dtype=DType.FP16)
    # q = 4*2 = 8, kv = 2*2 = 4 rows each.
    assert by_name(spec)["layers.1.attn.qkv"].parts == (8, 4, 4)
    assert spec.dtype(StateKind.PARAM) is DType.FP16
    assert resolve_model(str(path)).config == spec.config


def test_load_yaml(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    text = "\n".join(f"{k}: {v}" for k, v in VALID.items())
    path.write_text(text + "\nexperts: 4\nexpert_ffn: 6\ntied_embeddings: true\n")
    spec = load_spec_file(path)
    assert spec.config.experts == 4
    assert spec.config.tied_embeddings
    assert by_name(spec)["layers.0.mlp.experts.3.down"].shape == (8, 6)
    assert resolve_model(str(path)).config == spec.config


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"colour": 1}, ["unknown", "colour"]),
        ({"hidden": -3}, ["hidden"]),
        ({"layers": 0}, ["layers"]),
        ({"ffn": 2.5}, ["ffn"]),
        ({"heads": "4"}, ["heads"]),
        ({"heads": True}, ["heads"]),
        ({"experts": -1}, ["experts"]),
        ({"kv_heads": 3}, ["kv_heads", "heads"]),
        ({"experts": 4}, ["experts", "expert_ffn"]),
        ({"expert_ffn": 4}, ["experts", "expert_ffn"]),
        ({"param_dtype": "int8"}, ["param_dtype", "bf16"]),
        ({"fused_qkv": "yes"}, ["fused_qkv"]),
        ({"name": ""}, ["name"]),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, change: dict[str, Any], names: list[str]) -> None:
    path = write(tmp_path, {**VALID, **change})
    with pytest.raises(ValueError) as err:
        load_spec_file(path)
    message = str(err.value)
    assert str(path) in message
    for name in names:
        assert name in message
    assert "\n" not in message


def test_missing_field_is_named(tmp_path: Path) -> None:
    data = {k: v for k, v in VALID.items() if k not in ("vocab", "ffn")}
    path = write(tmp_path, data)
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['ffn', 'vocab'\]"):
        load_spec_file(path)


def test_malformed_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\nvocab: 3\n")
    with pytest.raises(ValueError, match="not valid JSON or YAML"):
        load_spec_file(path)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", ""])
def test_non_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="expected a mapping"):
        load_spec_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read model file"):
        load_spec_file(tmp_path / "absent.yaml")


def test_non_string_keys_are_a_clean_error() -> None:
    """YAML allows non-string keys (`1: 2`, `yes: 3`). Mixed with an unknown string key, the
    committed code sorted the unknown names together and raised TypeError (a traceback from the
    CLI) instead of the ValueError that names the fields."""
    with pytest.raises(ValueError, match="unknown field"):
        config_from_dict({**VALID, 1: 2, "colour": 3}, "model.yaml")
    with pytest.raises(ValueError, match="unknown field"):
        config_from_dict({**VALID, True: 2, None: 1}, "model.yaml")


def test_resolve_model() -> None:
    assert resolve_model("tiny") is preset("tiny")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        resolve_model("nope")
    with pytest.raises(ValueError, match="unknown model"):
        preset("nope")
