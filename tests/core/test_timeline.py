"""`liveshard timeline`: a real `liveshard-local` run drawn as a PNG (its layouts as bands, its
switch and recovery counted), and bad event files refused naming the file and the line; a job on a
cluster from its status (`timeline-job.json`, recorded from the local cluster's job of
tests/e2e/test_operator.py scaled 4 -> 2 -> 3), read through a kubectl stand-in, and the job's
problems (no kubectl, no such job, no progress yet) refused by name."""

from __future__ import annotations

import copy
import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib import image

from liveshard_core.cli import main
from liveshard_core.cli.story import bands, short_layout
from liveshard_core.cli.timeline import read_events
from liveshard_core.cli.timeline_job import story_of

BIN = Path(sys.executable).parent
RECORDED: dict[str, Any] = json.loads(Path(__file__).with_name("timeline-job.json").read_text())
LAYOUT = "dp={},tp=1,pp=1,ep=1,zero=1,pp_layers=4"


def test_a_real_run_is_drawn_with_its_layouts_and_reconfigurations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch", reason="liveshard-local needs torch (the agent extra)")
    events = tmp_path / "events.jsonl"
    command = [str(BIN / "liveshard-local"), "--nprocs", "3", "--steps", "12", "--switch",
               "4:dp=2", "--kill", "8:1", "--json"]  # fmt: skip
    with events.open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.PIPE, check=True, timeout=300)
    story = read_events(events)
    assert [s.step for s in story.steps] == list(range(12))
    assert [b[2] for b in bands(story.steps)][:2] == [
        "dp=3,tp=1,pp=1,ep=1,zero=0,pp_layers=4", "dp=2,tp=1,pp=1,ep=1,zero=0,pp_layers=4",
    ]  # fmt: skip
    labels = [r.label for r in story.reconfigurations]
    assert labels[0] == "switch -> dp=2 zero=0 (2 members)"
    assert labels[1].startswith("recovery (lost ")
    png = tmp_path / "story.png"
    assert main(["timeline", "--events", str(events), "--out", str(png), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"out": str(png), "steps": 12, "layouts": len(bands(story.steps)),
                       "reconfigurations": len(story.reconfigurations)}  # fmt: skip
    pixels = image.imread(png)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20  # not blank


def test_short_layout_names_the_degrees_that_matter_and_the_members() -> None:
    assert short_layout("dp=2,tp=2,pp=1,ep=1,zero=1,pp_layers=4") == "dp=2 tp=2 zero=1 (4 members)"
    assert short_layout("dp=2,tp=1,pp=2,ep=2,zero=3,pp_layers=1:3") == (
        "dp=2 pp=2 ep=2 zero=3 (4 members)"
    )
    assert short_layout("dp=1,tp=1,pp=1,ep=1,zero=0,pp_layers=4") == "zero=0 (1 member)"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"event": "step", "step": 0}\n', "events.jsonl:1: a step event without"),
        ('{"event": "step", "step": 0, "loss": 1, "layout": "dp=1", "step_seconds": 1, '
         '"tokens": 8}\nnot json\n', "events.jsonl:2: not a JSON line"),
        ("[1, 2]\n", "events.jsonl:1: expected a JSON object, got list"),
        ('{"event": "checkpoint"}\n', "no step events"),
    ],
)  # fmt: skip
def test_bad_event_files_exit_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text(text)
    out = tmp_path / "story.png"
    assert main(["timeline", "--events", str(events), "--out", str(out)]) == 2
    assert words in capsys.readouterr().err and not out.exists()
    missing = main(["timeline", "--events", str(tmp_path / "none"), "--out", str(out)])
    assert missing == 2 and "No such file" in capsys.readouterr().err


def test_a_recorded_job_becomes_the_story_its_status_tells() -> None:
    story = story_of(RECORDED)
    samples = RECORDED["status"]["progress"]
    assert story.title == "job test-scale-down-and-up-live-eaecb/tiny"
    # Each sample names the next step to train; it is drawn at the one its loss is of.
    assert [s.step for s in story.steps] == [p["step"] - 1 for p in samples]
    assert [s.loss for s in story.steps] == [p["loss"] for p in samples]
    assert story.steps[0].tokens_per_second is None and story.steps[0].seconds == 0
    assert all(s.tokens_per_second and s.tokens_per_second > 0 for s in story.steps[1:])
    seconds = [s.seconds or 0.0 for s in story.steps]
    assert seconds == sorted(seconds) and 20 < seconds[-1] < 25
    assert [b[2] for b in bands(story.steps)] == [LAYOUT.format(4), LAYOUT.format(2),
                                                   LAYOUT.format(3)]  # fmt: skip
    # Its reconfigurations: the first world, then the two resizes, each drawn before the step
    # the job was at when the operator saw it end (a band begins at its first sample).
    labels = [r.label for r in story.reconfigurations]
    assert labels == ["start -> dp=4 zero=1 (4 members)", "scale 4 -> 2 -> dp=2 zero=1 (2 members)",
                      "scale 2 -> 3 -> dp=3 zero=1 (3 members)"]  # fmt: skip
    history = RECORDED["status"]["history"]
    assert [r.step for r in story.reconfigurations] == [h["step"] - 1 for h in history]
    assert all(r.committed for r in story.reconfigurations)
    assert [r.pause_seconds for r in story.reconfigurations] == [0, 0.1439, 0.7824]
    assert [r.bytes_moved for r in story.reconfigurations] == [0, 920320, 1540272]


def test_an_aborted_reconfiguration_is_drawn_as_such() -> None:
    job = copy.deepcopy(RECORDED)
    job["status"]["history"].append({
        "epoch": 3, "reason": "lost tiny-x; evicting tiny-y", "from": LAYOUT.format(3),
        "to": LAYOUT.format(2), "pauseSeconds": 2.5, "bytesMoved": 0, "result": "aborted",
        "message": "epoch 3: no surviving copy", "step": 115, "time": "2026-11-25T17:50:31Z",
    })  # fmt: skip
    aborted = story_of(job).reconfigurations[-1]
    assert not aborted.committed and aborted.step == 114
    assert aborted.label == "lost tiny-x; evicting tiny-y aborted"


def test_a_resume_is_named_by_its_checkpoint_not_its_path() -> None:
    job = copy.deepcopy(RECORDED)
    job["status"]["history"][0]["reason"] = (
        "resume from /root/.cache/liveshard/run/demo/checkpoints/suspend-1 (step 756); "
        "start with 3 feasible layouts use 2 of 2 members"
    )
    assert story_of(job).reconfigurations[0].label == (
        "resume from .../suspend-1 (step 756) -> dp=4 zero=1 (4 members)"
    )


def kubectl_stand_in(tmp_path: Path, job: dict[str, Any] | None) -> Path:
    """A kubectl that records its arguments and KUBECONFIG, and prints `job` (None: as kubectl
    does for a job that does not exist)."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    found = f"cat {tmp_path / 'job.json'}"
    missing = ('echo \'Error from server (NotFound): elastictrainingjobs.liveshard.io "nope" '
               'not found\' >&2; exit 1')  # fmt: skip
    script = tmp_path / "kubectl"
    script.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > {tmp_path / "args"}
echo "$KUBECONFIG" > {tmp_path / "env"}
{found if job is not None else missing}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_job_is_read_with_kubectl_and_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    kubectl = kubectl_stand_in(tmp_path, RECORDED)
    monkeypatch.setenv("KUBECONFIG", "/from/the/environment")
    png = tmp_path / "job.png"
    argv = ["timeline", "--job", "tiny", "-n", "ns", "--context", "dev", "--kubeconfig", "/k",
            "--kubectl", str(kubectl), "--out", str(png), "--json"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {
        "out": str(png), "steps": 10, "layouts": 3, "reconfigurations": 3,
    }  # fmt: skip
    assert (tmp_path / "args").read_text().split("\n")[:-1] == [
        "get", "elastictrainingjobs.liveshard.io", "tiny", "-o", "json", "--namespace", "ns",
        "--kubeconfig", "/k", "--context", "dev",
    ]  # fmt: skip
    assert (tmp_path / "env").read_text() == "/from/the/environment\n"  # kubectl's own too
    pixels = image.imread(png)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20  # not blank


def test_a_job_without_progress_yet_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = copy.deepcopy(RECORDED)
    job["status"] = {"phase": "Pending"}
    kubectl = kubectl_stand_in(tmp_path, job)
    out = tmp_path / "job.png"
    assert main(["timeline", "--job", "tiny", "--kubectl", str(kubectl), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "has no progress yet (phase: Pending)" in err and not out.exists()


def test_a_missing_job_and_a_missing_kubectl_exit_2_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "job.png"
    kubectl = kubectl_stand_in(tmp_path, None)
    assert main(["timeline", "--job", "nope", "-n", "ns", "--kubectl", str(kubectl),
                 "--out", str(out)]) == 2  # fmt: skip
    assert "job ns/nope does not exist: Error from server (NotFound)" in capsys.readouterr().err
    nowhere = str(tmp_path / "no-kubectl")
    assert main(["timeline", "--job", "nope", "--kubectl", nowhere, "--out", str(out)]) == 2
    assert f"--kubectl {nowhere!r}: no such program" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "sources", [[], ["--events", "e.jsonl", "--job", "tiny"]], ids=["neither", "both"]
)
def test_exactly_one_source_is_required(
    sources: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["timeline", *sources, "--out", "x.png"])
    assert exited.value.code == 2
    assert "--events" in capsys.readouterr().err
