"""Hugging Face configs read into liveshard's: every field that changes the math honoured, and
what liveshard cannot compute exactly refused with an error naming it. No torch: configs are
written as transformers 4.x and 5.x write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from liveshard_core.errors import InvalidInput
from liveshard_core.job import JobConfig, TrainingSettings
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import ModelSpec

BASE: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
}  # fmt: skip


def write(tmp_path: Path, arch: str, **fields: Any) -> Path:
    directory = tmp_path / arch
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [arch], **BASE, **fields}))
    return directory


def test_each_family_maps_its_fields(tmp_path: Path) -> None:
    llama = HfModel.load(write(tmp_path, "LlamaForCausalLM", attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, rope_theta=500000))  # fmt: skip
    c = llama.config
    assert (c.norm_eps, c.qkv_bias, c.o_bias, c.head_dim) == (1e-5, True, True, 16)
    assert (c.rope_type, c.rope_theta, c.rope_factor, c.rope_original_positions) == (
        "llama3", 500000.0, 8.0, 16)  # fmt: skip
    qwen2 = HfModel.load(write(tmp_path, "Qwen2ForCausalLM")).config
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    rope = {"rope_type": "default", "rope_theta": 1e6}  # transformers 5's spelling
    qwen3 = HfModel.load(write(tmp_path, "Qwen3ForCausalLM", head_dim=32,
                               tie_word_embeddings=True, rope_parameters=rope)).config  # fmt: skip
    assert (qwen3.qk_norm, qwen3.tied_embeddings, qwen3.head_dim, qwen3.rope_theta) == (
        True, True, 32, 1e6)  # fmt: skip
    moe = HfModel.load(write(tmp_path, "Qwen3MoeForCausalLM", num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=24)).config  # fmt: skip
    assert (moe.experts, moe.expert_ffn, moe.top_k, moe.norm_topk_prob) == (8, 24, 2, False)
    mixtral = HfModel.load(write(tmp_path, "MixtralForCausalLM", num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=4096)).config  # fmt: skip
    assert (mixtral.experts, mixtral.expert_ffn, mixtral.norm_topk_prob) == (4, 96, True)
    assert mixtral.sliding_window == 4096


def test_the_table_names_every_hugging_face_tensor_once(tmp_path: Path) -> None:
    for arch, extra in [("Qwen2ForCausalLM", {}), ("MixtralForCausalLM", {"num_local_experts": 2,
                        "num_experts_per_tok": 1})]:  # fmt: skip
        model = HfModel.load(write(tmp_path, arch, **extra))
        names = [s.name for sources in model.sources(ModelSpec.from_config(model.config))
                 for s in sources]  # fmt: skip
        assert len(names) == len(set(names))
        assert "model.layers.1.self_attn.k_proj.bias" in names or arch != "Qwen2ForCausalLM"
        if arch == "MixtralForCausalLM":
            assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in names
            assert "model.layers.0.block_sparse_moe.gate.weight" in names
    # A fused qkv is its three parts, each a slice of the logical tensor.
    model = HfModel.load(write(tmp_path, "Qwen2ForCausalLM"))
    spec = ModelSpec.from_config(model.config)
    qkv = spec.params.index(next(p for p in spec.params if p.name == "layers.0.attn.qkv"))
    assert [(s.name.rsplit(".", 2)[1], s.start, s.stop) for s in model.sources(spec)[qkv]] == [
        ("q_proj", 0, 64), ("k_proj", 64, 96), ("v_proj", 96, 128)]  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "fields", "named"),
    [
        ("GPT2LMHeadModel", {}, "architectures"),
        ("Qwen2ForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
        ("Qwen3ForCausalLM", {"layer_types": ["sliding_attention", "full_attention"]},
         "layer_types"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 8, "mlp_only_layers": [1]},
         "mlp_only_layers"),
        ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                "router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("LlamaForCausalLM", {"vocab_size": None}, "vocab_size"),
    ],
)  # fmt: skip
def test_what_cannot_be_computed_exactly_is_refused_by_name(
    tmp_path: Path, arch: str, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidInput, match=named) as caught:
        HfModel.load(write(tmp_path, arch, **fields))
    assert "config.json" in str(caught.value)


def test_a_job_names_its_directory_and_checks_the_window(tmp_path: Path) -> None:
    directory = write(tmp_path, "MistralForCausalLM", sliding_window=32)
    config = JobConfig.from_json(json.dumps({"model": {"path": str(directory), "init": "random"},
                                             "training": {"seq_len": 32}}))  # fmt: skip
    assert JobConfig.from_json(config.to_json()) == config
    assert config.model == resolve_model(str(directory)).config
    assert not config.pretrained  # random, and the directory has no weights anyway
    with pytest.raises(InvalidInput, match=r"seq_len=64 exceeds the model's sliding_window=32"):
        JobConfig(model=config.model, training=TrainingSettings(seq_len=64))
    with pytest.raises(InvalidInput, match=r"model.init=pretrained needs a model directory"):
        JobConfig(model=config.model, init="pretrained")
    with pytest.raises(InvalidInput, match=r"model.path: cannot read .*config.json"):
        JobConfig.from_json(json.dumps({"model": {"path": str(tmp_path / "none")}}))
