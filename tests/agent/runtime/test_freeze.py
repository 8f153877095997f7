"""Progressive layer freezing on real local jobs (gloo, CPU, fp32); each job starts 2 processes.

`tiny-moe` (untied embeddings, MoE layers) trains 8 steps with `--freeze 2:1 --freeze 4:2`: layer 0
and the input embedding are frozen from step 2, layers 0 and 1 from step 4.
- The losses agree step by step, within test_training's relative tolerance, in dp=2 with ZeRO-3
  and in pp=2 (from step 4 stage 0's layers are all frozen: it runs no backward and stage 1 asks
  for no input gradient), and through a live switch made while layers are frozen.
- Frozen means frozen: in the ZeRO-3 run's checkpoints, every frozen weight's value and Adam
  moments are bit for bit those of the step its freeze began, while the weights that train
  changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from liveshard_agent.local.launcher import LocalJob, local_config, parse_switch, run_job
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from tests.agent.runtime.test_training import RTOL, losses

STEPS = 8
SETTINGS = TrainingSettings(
    steps=STEPS, global_batch=4, micro_batch=1, dropout=0.1, freeze=((2, 1), (4, 2))
)
MODEL = "tiny-moe"


def train(layout: str, *switches: str, **options: Any) -> list[dict[str, Any]]:
    degrees = parse_degrees(layout)
    return run_job(
        LocalJob(
            config=local_config(MODEL, SETTINGS), nprocs=degrees.world_size, layout=degrees,
            switches=tuple(parse_switch(s) for s in switches), **options,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """The reference run, dp=2 with ZeRO-3, and its checkpoints (every 2 steps)."""
    directory = tmp_path_factory.mktemp("checkpoints")
    return train("dp=2,zero=3", checkpoint_dir=str(directory), checkpoint_every=2), directory


def assert_same_losses(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    a, b = losses(got), losses(expected)
    assert len(a) == len(b) == STEPS
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == pytest.approx(y, rel=RTOL), f"step {step}: {x} != {y}"


def test_frozen_training_is_the_same_with_a_pipeline(zero3: tuple[Any, Path]) -> None:
    assert_same_losses(train("pp=2"), zero3[0])


def test_a_switch_while_layers_are_frozen_trains_as_a_run_without(
    zero3: tuple[Any, Path],
) -> None:
    events = train("dp=2,zero=1", "3:pp=2")
    (switch,) = [e for e in events if e["event"] == "switch"]
    assert switch["result"] == "committed" and 3 <= switch["step"] < STEPS, switch
    assert_same_losses(events, zero3[0])


def whole(directory: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint of `step`, whole, by `name` or `name:kind`."""
    path = directory / f"whole-{step}.pt"
    dcp_to_torch_save(str(directory / f"step-{step}"), str(path))
    state = torch.load(path, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> bool:
    """Whether every tensor whose key starts with `prefix` is bit for bit the same."""
    keys = [k for k in a if k.startswith(prefix)]
    assert keys, prefix
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_frozen_weights_and_their_moments_stay_bit_for_bit(zero3: tuple[Any, Path]) -> None:
    before, at_4, last = (whole(zero3[1], step) for step in (2, 4, STEPS))
    assert any(k.endswith(":exp_avg_sq") for k in last)  # the moments are there too
    # Layer 0 and the (untied) input embedding, frozen from step 2.
    assert same(before, last, "layers.0.") and same(before, last, "embed")
    # Layer 1 trained until step 4, then froze.
    assert not same(before, at_4, "layers.1.") and same(at_4, last, "layers.1.")
    # The rest trains: every tensor of it changed (but an expert no token was routed to, whose
    # moments stay zero).
    trained = ("layers.2.", "layers.3.", "final_norm", "lm_head")
    for key in last:
        if key.startswith(trained) and ".experts." not in key:
            assert not torch.equal(at_4[key], last[key]), key
