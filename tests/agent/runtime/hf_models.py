"""Tiny random Hugging Face models of every family liveshard loads, created and saved by
transformers itself (the reference), and transformers' loss on a batch of liveshard's data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

transformers = __import__("pytest").importorskip("transformers")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
# Each family with what sets it apart switched on: scaled rotary frequencies, a head_dim apart
# from hidden / heads, q/k/v biases, q/k norms with tied embeddings, unnormalised and normalised
# top-k routing.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", dict(rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5, attention_bias=True)),
    "mistral": ("Mistral", dict(head_dim=24, sliding_window=4096)),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3moe": (
        "Qwen3Moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    ),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def make_model(family: str, directory: Path, seed: int = 0) -> Path:
    """A random model of `family` saved in `directory`; norms and biases are moved off their
    initial ones and zeros, so that a wrong mapping of them shows."""
    prefix, options = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**COMMON, **options)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


def load(directory: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def loss(model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy of `model` on the batch, as liveshard reports it."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
