"""`liveshard-local`, the command: its JSON lines, its refusals of what cannot run, its `--kill`
syntax. What it runs (training through switches and recoveries) is tested in
`tests/agent/runtime`, which drives the runtime through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from liveshard_agent.local.launcher import ScriptedKill, _parser, job_from_args, parse_kill
from liveshard_agent.local.start import START_METHOD
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


def test_members_spawned_or_forked_from_a_server_train_the_same() -> None:
    # The suite forks its members (tests/conftest.py); the default, a fresh interpreter per member
    # as in a pod, is run here, through a death whose member is started anew.
    def run(method: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(LIVESHARD_LOCAL), "--model", "tiny", "--steps", "6", "--nprocs", "2",
             "--kill", "3:1", "--json"],
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, START_METHOD: method},
        )  # fmt: skip

    losses = {}
    for method in ("spawn", "forkserver"):
        done = run(method)
        assert done.returncode == 0, done.stderr
        events = [json.loads(line) for line in done.stdout.splitlines()]
        assert [e["member"] for e in events if e["event"] == "lost"] == ["w1"], events
        losses[method] = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    assert losses["spawn"] == losses["forkserver"]
    assert [step for step, _ in losses["spawn"]] == list(range(6))
    bad = run("fork")
    assert bad.returncode == 2
    assert f"{START_METHOD}='fork': expected spawn or forkserver" in bad.stderr


def test_kill_is_parsed_and_refused_when_malformed() -> None:
    assert parse_kill("15:1") == ScriptedKill(15, 1)
    for text in ("15", "a:1", "15:-1", "15:x"):
        with pytest.raises(InvalidInput, match="STEP:RANK"):
            parse_kill(text)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--kill", "3:2"], "--kill 3:2:step: the layout it happens in, dp=2,tp=1,pp=1,ep=1,"
                            "zero=0, has ranks 0 to 1"),
        (["--hang", "3:0:vote"], "--hang 3:0:vote: no switch is scripted at step 3"),
        # Inside a switch, ranks are the layout's it leaves; from its step on, the new one's.
        (["--switch", "3:dp=4", "--kill", "3:3:commit"], "--kill 3:3:commit: the layout it "
                                                          "happens in, dp=2"),
        (["--switch", "3:dp=4", "--switch", "3:dp=1"], "one switch per step, in step order"),
    ],
)  # fmt: skip
def test_kills_and_switches_that_cannot_happen_are_refused(flags: list[str], error: str) -> None:
    job = job_from_args(_parser().parse_args(["--nprocs", "2", *flags]))
    with pytest.raises(InvalidInput, match=error):
        job.check()


def test_switches_are_made_in_step_order_whatever_the_flags_order() -> None:
    flags = ["--nprocs", "2", "--switch", "8:dp=1", "--switch", "4:dp=4", "--kill", "4:3"]
    job = job_from_args(_parser().parse_args(flags))
    job.check()  # rank 3 is one of dp=4's, in effect from step 4
    assert [s.step for s in job.switches] == [4, 8]


def test_a_job_that_ends_with_a_switch_pending_ends_cleanly() -> None:
    # The member killed in the vote is recovered; the growth, sent again, is still preparing
    # when the last step is trained (on this machine: "unmade"), its store and groups half
    # built: every process ends without torch tearing them down (it aborted the process).
    done = subprocess.run(
        [str(LIVESHARD_LOCAL), "--model", "tiny", "--steps", "12", "--nprocs", "2", "--layout",
         "dp=2,zero=1,mirror=1", "--switch", "5:dp=4,zero=1,mirror=1", "--kill", "5:0:vote",
         "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["member"] for e in events if e["event"] == "lost"] == ["w0"]
    assert "terminate called" not in done.stderr, done.stderr
