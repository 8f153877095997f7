"""`liveshard-cluster up|status|down` as a user runs it: a second, one-node cluster beside the
session's. Needs the built binaries (skips like the other e2e tests without them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from liveshard_e2e.cluster import ClusterInfo

NAME = "cli-test"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "liveshard-cluster"
    return subprocess.run(
        [str(script), "--name", NAME, *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=dict(os.environ),
    )


def test_up_is_idempotent_and_down_stops_it(local_cluster: ClusterInfo) -> None:
    del local_cluster  # only for its skip-or-fail check on the binaries
    try:
        first = _cli("up", "--nodes", "1")
        assert first.returncode == 0, first.stderr
        lines = first.stdout.splitlines()
        kubeconfig = Path(lines[0])
        assert kubeconfig.is_absolute() and kubeconfig.exists()
        tools = dict(line.split(" ", 1) for line in lines[1:])
        assert Path(tools["kubectl"]).exists() and Path(tools["helm"]).exists()
        assert tools["nodes"] == "node-0"

        again = _cli("up", "--nodes", "1")
        assert again.returncode == 0 and again.stdout == first.stdout  # the same cluster

        status = _cli("status")
        assert status.returncode == 0 and status.stdout.splitlines()[0] == str(kubeconfig)
        nodes = subprocess.run(
            [tools["kubectl"], "--kubeconfig", str(kubeconfig), "get", "nodes", "-o", "name"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert nodes.stdout.split() == ["node/node-0"]
    finally:
        down = _cli("down")
    assert down.returncode == 0, down.stderr
    after = _cli("status")
    assert after.returncode == 1 and "not running" in after.stderr
