"""`liveshard timeline`: a real `liveshard-local` run drawn as a PNG (its layouts as bands, its
switch and recovery counted), and bad event files refused naming the file and the line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from liveshard_core.cli import main
from liveshard_core.cli.timeline import bands, read_events, short_layout

BIN = Path(sys.executable).parent


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
