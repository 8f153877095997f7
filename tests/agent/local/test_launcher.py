"""`liveshard-local`, the command: its JSON lines, its refusals of what cannot run, its `--kill`
syntax. What it runs (training through switches and recoveries) is tested in
`tests/agent/runtime`, which drives the runtime through it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from liveshard_agent.local.launcher import ScriptedKill, parse_kill
from liveshard_core.errors import InvalidInput

LIVESHARD_LOCAL = Path(sys.executable).parent / "liveshard-local"


def test_the_command_prints_json_lines_and_rejects_a_batch_that_cannot_divide() -> None:
    done = subprocess.run(
        [str(LIVESHARD_LOCAL), "--model", "tiny", "--steps", "10", "--nprocs", "2",
         "--switch", "1:tp=2", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(10))
    assert set(steps[0]) >= {"step", "loss", "layout", "epoch", "step_seconds", "tokens"}
    (switch,) = [e for e in events if e["event"] == "switch"]
    assert set(switch) >= {"step", "from", "to", "pause_seconds", "prepare_seconds",
                           "network_bytes", "result", "reason"}  # fmt: skip
    # At the first boundary at or after step 1 at which every member is prepared.
    assert switch["step"] >= 1 and switch["result"] == "committed"
    assert [e["layout"] == switch["to"] for e in steps] == [
        e["step"] >= switch["step"] for e in steps
    ]
    bad = subprocess.run(
        [str(LIVESHARD_LOCAL), "--model", "tiny", "--nprocs", "4", "--switch", "5:dp=5"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--switch 5:dp=5: global batch 24 does not divide into dp=5" in bad.stderr
    late = subprocess.run(
        [str(LIVESHARD_LOCAL), "--model", "tiny", "--steps", "10", "--switch", "10:dp=2",
         "--kill", "12:0"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert late.returncode == 2
    assert "--switch 10:dp=2, --kill 12:0:step: the job trains steps 0 to 9" in late.stderr


def test_kill_is_parsed_and_refused_when_malformed() -> None:
    assert parse_kill("15:1") == ScriptedKill(15, 1)
    for text in ("15", "a:1", "15:-1", "15:x"):
        with pytest.raises(InvalidInput, match="STEP:RANK"):
            parse_kill(text)
