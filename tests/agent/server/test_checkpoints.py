"""A checkpoint that cannot be saved, asked through the API: 1 agent process, a job of a few steps.

The agent reports the failure in its status (`failed_checkpoint`, with the reason) and goes on as
before; the next checkpoint is saved and clears it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the agent needs torch (the agent extra)")

from liveshard.v1 import agent_pb2 as pb

from .agents import CONFIG, Phase, agents, layout


def test_a_failed_checkpoint_is_reported_and_the_next_one_is_saved(tmp_path: Path) -> None:
    """1 agent process: a job of 6 steps; checkpoint 1 to a path under a regular file fails,
    the agent stays DONE, saying why; checkpoint 2 to a directory is saved."""
    config = {**CONFIG, "training": {**CONFIG["training"], "steps": 6}}  # type: ignore[dict-item]
    afile = tmp_path / "afile"
    afile.write_text("")
    with agents(["solo"], tmp_path, LIVESHARD_CONFIG=json.dumps(config)) as started:
        solo = started["solo"]
        store = solo.call("HostStore", pb.HostStoreRequest(epoch=0)).address
        solo.call("Prepare", pb.PrepareRequest(epoch=0, store=store, to=layout(["solo"])))
        solo.wait_for("the end", lambda s: s.phase == Phase.DONE)
        bad = str(afile / "step-6")
        solo.call("Checkpoint", pb.CheckpointRequest(number=1, path=bad, at_step=6))
        status = solo.wait_for("the failure", lambda s: s.failed_checkpoint.number == 1)
        failed = status.failed_checkpoint
        assert (failed.step, failed.path) == (6, bad) and "Not a directory" in failed.error
        assert status.phase == Phase.DONE and not status.HasField("last_checkpoint")
        good = str(tmp_path / "step-6")
        solo.call("Checkpoint", pb.CheckpointRequest(number=2, path=good, at_step=6))
        saved = solo.wait_for("the checkpoint", lambda s: s.last_checkpoint.number == 2)
        assert saved.last_checkpoint.path == good and not saved.HasField("failed_checkpoint")
        assert (Path(good) / "liveshard.json").is_file()
        solo.call("Release", pb.ReleaseRequest())
        assert solo.wait_exit() == 0
