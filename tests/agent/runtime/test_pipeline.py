"""1F1B against GPipe on real local jobs (gloo, CPU, fp32).

- The same job under both schedules trains the same: per-step losses equal bit for bit, and so
  is the final state (every tensor of a checkpoint of the last step, optimizer moments included),
  at pp = 2 and 4, dp = 1 and 2, and with MoE layers (ep = 2): both schedules run a stage's
  backwards in the order of its forwards, so gradients sum in the same order. Each job starts up
  to 8 processes (`liveshard-local`'s `run_job`).
- The activations a stage holds at its peak, measured in one step of pp = 4 with 8 micro-batches
  (4 worker processes, `pipeline_tasks`): the storages autograd saves for backward, by micro-
  batch. GPipe holds all 8 micro-batches' on every stage; 1F1B at most pp - stage (4 on the
  first stage), so half the bytes there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from liveshard_agent.local.launcher import LocalJob, local_config, run_job
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from liveshard_e2e.workers import Pool
from tests.helpers import names

STEPS = 3
SETTINGS = TrainingSettings(steps=STEPS, global_batch=8, micro_batch=1, dropout=0.1)
SCHEDULES = ("gpipe", "1f1b")
_epochs = itertools.count(1)


def train(model: str, layout: str, schedule: str, directory: Path) -> list[dict[str, Any]]:
    degrees = parse_degrees(layout)
    settings = dataclasses.replace(SETTINGS, pipeline_schedule=schedule)
    return run_job(
        LocalJob(
            config=local_config(model, settings), nprocs=degrees.world_size, layout=degrees,
            switches=(), checkpoint_dir=str(directory), checkpoint_every=STEPS,
        )
    )  # fmt: skip


def final_state(directory: Path) -> dict[str, Any]:
    """Every tensor of the checkpoint of the last step, whole."""
    whole = directory / "whole.pt"
    dcp_to_torch_save(str(directory / f"step-{STEPS}"), str(whole))
    state: dict[str, Any] = torch.load(whole, weights_only=False)
    return state


@pytest.mark.parametrize(
    ("model", "layout"),
    [("tiny", "pp=2,dp=2"), ("tiny", "pp=4"), ("tiny-moe", "pp=2,dp=2,ep=2")],
)  # fmt: skip
def test_1f1b_trains_exactly_as_gpipe(model: str, layout: str, tmp_path: Path) -> None:
    runs = {s: train(model, layout, s, tmp_path / s) for s in SCHEDULES}
    losses = {s: [e["loss"] for e in ev if e["event"] == "step"] for s, ev in runs.items()}
    assert len(losses["1f1b"]) == STEPS
    assert losses["1f1b"] == losses["gpipe"]  # bit for bit
    gpipe, one_f_one_b = (final_state(tmp_path / s) for s in SCHEDULES)
    assert sorted(one_f_one_b) == sorted(gpipe)
    tensors = [k for k, v in gpipe.items() if isinstance(v, torch.Tensor)]
    assert any(k.endswith(":exp_avg") for k in tensors)  # the optimizer's state too
    for name in tensors:
        assert torch.equal(one_f_one_b[name], gpipe[name]), name


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    workers = Pool(4, "tests.agent.runtime.pipeline_tasks", threads=1)
    yield workers
    workers.close()


def metered_step(pool: Pool, layout: str, schedule: str) -> dict[int, dict[str, Any]]:
    """One step of `tiny` in `layout` under `schedule` on the pool's workers; each stage's
    measurements (tp and dp rank 0's)."""
    members = names(parse_degrees(layout).world_size)
    port = pool.run({0: ("host", {})})[0]
    settings = dataclasses.asdict(dataclasses.replace(SETTINGS, pipeline_schedule=schedule))
    epoch = next(_epochs)
    results = pool.run(
        {i: ("step", dict(member=m, port=port, epoch=epoch, model="tiny", layout=layout,
                          members=members, settings=settings))
         for i, m in enumerate(members)}
    )  # fmt: skip
    by_stage: dict[int, dict[str, Any]] = {}
    for result in results.values():
        by_stage.setdefault(result["stage"], result)
    return by_stage


def test_1f1b_holds_at_most_pp_micro_batches_where_gpipe_holds_all(pool: Pool) -> None:
    pp, micro = 4, SETTINGS.global_batch // SETTINGS.micro_batch
    gpipe, one_f_one_b = (metered_step(pool, f"pp={pp}", s) for s in SCHEDULES)
    assert one_f_one_b[pp - 1]["loss"] == gpipe[pp - 1]["loss"]
    for stage in range(pp):
        assert gpipe[stage]["peak_micro_batches"] == micro
        assert one_f_one_b[stage]["peak_micro_batches"] == pp - stage
        # Every micro-batch saves the same bytes on a stage: the peaks are in that ratio.
        per_micro_batch = gpipe[stage]["peak_bytes"] / micro
        assert per_micro_batch > 0
        assert one_f_one_b[stage]["peak_bytes"] == pytest.approx((pp - stage) * per_micro_batch)
        assert gpipe[stage]["left_bytes"] == one_f_one_b[stage]["left_bytes"] == 0
    print(
        "peak saved activations per stage, tiny, pp=4, 8 micro-batches of 1x64 tokens: "
        + ", ".join(
            f"stage {i}: gpipe {gpipe[i]['peak_bytes'] / 2**20:.2f} MiB, "
            f"1f1b {one_f_one_b[i]['peak_bytes'] / 2**20:.2f} MiB"
            for i in range(pp)
        )
    )
