"""Hugging Face models trained by liveshard compute what transformers computes.

Tiny random models of each family are created and saved by transformers; liveshard loads their
safetensors sharded (each member reads only its own boxes) in several layouts, and its loss at
step 0 equals transformers' on the same batch (fp32, 1e-5 relative). Then a job trains with
live switches between layouts and its losses follow a transformers + torch.optim.AdamW run on
the same batches (same schedule, weight decay on matrices only, gradients clipped by their global
norm as `clip_grad_norm_` does).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

import torch

from liveshard_agent.local.launcher import LocalJob, local_config, parse_switch, run_job
from liveshard_agent.runtime.data import Dataset, load_corpus
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from tests.agent.runtime import hf_models

SETTINGS = TrainingSettings(steps=1, global_batch=8, micro_batch=2, seq_len=32, dropout=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: hf_models.make_model(f, root / f) for f in hf_models.FAMILIES}


def run(model: Path, layout: str, settings: TrainingSettings, *switches: str) -> list[Any]:
    degrees = parse_degrees(layout)
    job = LocalJob(
        config=local_config(str(model), settings), nprocs=degrees.world_size, layout=degrees,
        switches=tuple(parse_switch(s) for s in switches),
    )  # fmt: skip
    steps = [e for e in run_job(job) if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(settings.steps))
    return steps


def batch(settings: TrainingSettings, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = Dataset(load_corpus(settings.data), settings.seq_len, settings.seed)
    b = data.batch(step * settings.global_batch, settings.global_batch)
    return b.inputs, b.targets


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("llama", "dp=2,pp=2,zero=3"),
        ("mistral", "tp=2"),
        ("qwen2", "tp=2,dp=2,zero=1"),
        ("qwen3", "pp=2,pp_layers=1:3"),
        ("qwen3", "tp=2,pp=2"),
        ("qwen3moe", "dp=4,ep=2,zero=3"),
        ("mixtral", "tp=2,dp=2,ep=2,zero=1"),
    ],
)
def test_the_loss_at_step_0_is_transformers_loss(
    models: dict[str, Path], family: str, layout: str
) -> None:
    (step,) = run(models[family], layout, SETTINGS)
    with torch.no_grad():
        expected = hf_models.loss(hf_models.load(models[family]), *batch(SETTINGS, 0)).item()
    assert step["loss"] == pytest.approx(expected, rel=1e-5)


def test_training_through_switches_follows_transformers_and_adamw(models: dict[str, Path]) -> None:
    settings = dataclasses.replace(
        SETTINGS, steps=6, lr=3e-3, warmup_steps=2, weight_decay=0.1, clip_norm=0.5
    )
    model_dir = models["qwen2"]
    got = [e["loss"] for e in run(model_dir, "dp=2", settings, "2:tp=2", "4:pp=2,pp_layers=1:3")]
    model = hf_models.load(model_dir)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=settings.lr, betas=(settings.beta1, settings.beta2),
                              eps=settings.eps)  # fmt: skip
    expected = []
    for step in range(settings.steps):
        loss = hf_models.loss(model, *batch(settings, step))
        expected.append(loss.item())
        adamw.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.clip_norm)
        for group in adamw.param_groups:
            group["lr"] = settings.learning_rate(step)
        adamw.step()
    assert got == pytest.approx(expected, rel=1e-4)
    assert expected[-1] < expected[0]  # it trained
