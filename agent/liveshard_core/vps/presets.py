"""Built-in model specs: small ones for CPU tests and real shapes for planning benchmarks."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from ..errors import InvalidInput
from .hf import HfModel
from .spec import ModelSpec, TransformerConfig, load_spec_file

CONFIGS = {
    c.name: c
    for c in (
        # Small enough to train on CPU; fused and tied structure exercised on purpose.
        TransformerConfig(
            name="tiny", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
            ffn=192, tied_embeddings=True, fused_qkv=True, fused_gate_up=True,
        ),
        # The built-in Hugging Face model (liveshard_agent.data.builtin): a tiny Qwen3 with a
        # 512-id BPE tokenizer; a job of this preset trains it on the tokenized built-in corpus.
        TransformerConfig(
            name="qwen3-tiny", vocab=512, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
            ffn=192, tied_embeddings=True, qk_norm=True, fused_qkv=True, fused_gate_up=True,
            norm_eps=1e-6,
        ),
        TransformerConfig(
            name="tiny-moe", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
            ffn=192, experts=8, expert_ffn=48, qk_norm=True,
        ),
        TransformerConfig(
            name="llama-70b", vocab=32000, hidden=8192, layers=80, heads=64, kv_heads=8,
            head_dim=128, ffn=28672,
        ),
        TransformerConfig(
            name="qwen3-235b-a22b", vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4,
            head_dim=128, ffn=12288, experts=128, expert_ffn=1536, qk_norm=True, top_k=8,
            rope_theta=1000000.0,
        ),
    )
}  # fmt: skip


@cache
def preset(name: str) -> ModelSpec:
    """A built-in spec by name."""
    try:
        return ModelSpec.from_config(CONFIGS[name])
    except KeyError:
        raise InvalidInput(f"unknown model {name!r}; presets: {sorted(CONFIGS)}") from None


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, a Hugging Face model directory, or the path of a JSON/YAML model file."""
    if name_or_path in CONFIGS:
        return preset(name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        return ModelSpec.from_config(HfModel.load(path).config)
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        return load_spec_file(path)
    raise InvalidInput(
        f"unknown model {name_or_path!r}; presets: {sorted(CONFIGS)}, a Hugging Face model "
        "directory or a JSON/YAML file"
    )
