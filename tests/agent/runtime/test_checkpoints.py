"""Checkpoints that cannot be saved: local jobs of 2 processes (gloo, CPU) that train `tiny` for 30
steps with a checkpoint every 10, compared with the one-process run of `test_training`.

A checkpoint that fails (its path is a regular file, a read-only directory, no byte can be
written, one member's write fails) is reported by a `checkpoint` line with `"result": "failed"`
and the reason, nothing is left at its path, and the job trains to its end with the same losses;
a later checkpoint saves and restores as usual.
"""

from __future__ import annotations

import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from liveshard_agent.local.launcher import run_job
from tests.agent.runtime.faults import cannot_grow_files, cannot_write_once, without_root
from tests.agent.runtime.test_training import RTOL, STEPS, assert_same_training, job, losses


def checkpoints(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "checkpoint"]


def test_checkpoints_to_a_regular_file_fail_and_training_goes_on(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    events = run_job(job("tiny", "dp=2", checkpoint_dir=str(afile), checkpoint_every=10))
    saves = checkpoints(events)
    assert [(c["number"], c["step"], c["result"]) for c in saves] == [
        (n, n * 10, "failed") for n in (1, 2, 3)
    ]
    for save in saves:
        assert save["path"] == f"{afile}/step-{save['step']}"
        assert "Not a directory" in save["reason"] and save["path"] in save["reason"]
    assert afile.read_text() == "not a directory"
    assert_same_training("tiny", events)


def test_checkpoints_to_a_read_only_directory_fail_and_training_goes_on() -> None:
    # The members run as nobody where the test runs as root: every folder above the locked one
    # lets anyone through (pytest's own tmp_path does not), so only its mode refuses the write.
    base = Path(tempfile.mkdtemp(prefix="liveshard-read-only-"))
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        events = run_job(job("tiny", "dp=2", checkpoint_dir=str(locked), checkpoint_every=10,
                             hooks=without_root))  # fmt: skip
        saves = checkpoints(events)
        assert [c["result"] for c in saves] == ["failed"] * 3
        assert all("Permission denied" in c["reason"] for c in saves)
        assert list(locked.iterdir()) == []
        assert_same_training("tiny", events)
    finally:
        shutil.rmtree(base)


def test_checkpoints_no_byte_of_which_can_be_written_fail_and_training_goes_on(
    tmp_path: Path,
) -> None:
    events = run_job(job("tiny", "dp=2", checkpoint_dir=str(tmp_path), checkpoint_every=10,
                         hooks=cannot_grow_files))  # fmt: skip
    saves = checkpoints(events)
    assert [(c["step"], c["result"]) for c in saves] == [(10, "failed"), (20, "failed"),
                                                          (30, "failed")]  # fmt: skip
    assert all("File too large" in c["reason"] for c in saves)
    assert list(tmp_path.iterdir()) == []
    assert_same_training("tiny", events)


def test_one_members_failed_write_fails_the_checkpoint_everywhere_and_the_next_saves(
    tmp_path: Path,
) -> None:
    events = run_job(job("tiny", "dp=2", checkpoint_dir=str(tmp_path), checkpoint_every=10,
                         hooks=partial(cannot_write_once, "w1")))  # fmt: skip
    first, *later = checkpoints(events)
    assert (first["step"], first["result"]) == (10, "failed")
    # DCP gathers every rank's outcome of the write: rank 0 fails with rank 1's reason.
    assert "rank 1: OSError" in first["reason"] and "No space left on device" in first["reason"]
    assert [(c["step"], c["result"]) for c in later] == [(20, "saved"), (30, "saved")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-20", "step-30"]
    assert_same_training("tiny", events)
    resumed = run_job(job("tiny", "dp=2", resume=str(tmp_path / "step-20")))
    assert [e["step"] for e in resumed if e["event"] == "step"] == list(range(20, STEPS))
    after = [e["loss"] for e in resumed if e["event"] == "step"]
    assert after == pytest.approx(list(losses(events)[20:]), rel=RTOL)
