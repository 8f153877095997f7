"""The benchmarks' quick runs end to end (`bench/reshard.py`, `training.py`, `control.py`,
`moe.py`, `snapshots.py`, `pod_proxy.py`, each `--quick`): the first two fail on a switch that
does not commit or lands a wrong byte; here their reports are checked for shape and for what must
hold whatever the machine (no timing asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from liveshard_operator.handlers import PERIOD

ROOT = Path(__file__).resolve().parents[2]


def run_bench(name: str, out: Path, *flags: str) -> Any:
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), "--quick", "--out", str(out), *flags],
        check=True, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_reshard_benchmark_quick(tmp_path: Path) -> None:
    rows = run_bench("reshard.py", tmp_path / "reshard.json")
    assert [r["transition"].split()[0] for r in rows] == ["dp", "tp", "pp"]
    for r in rows:
        assert 0 < r["network_bytes"] <= r["state_bytes"]
        assert r["rounds"] > 0 and r["pairs"] > 0
        assert r["bounded_within_budget_plus_growth"]
        assert r["bounded_peak_extra_bytes"] <= r["peak_extra_bytes"] + r["budget_bytes"]
        for key in ("switch_seconds", "checkpoint_restart_seconds", "raw_transport_seconds"):
            assert r[key] > 0


def test_training_benchmark_quick(tmp_path: Path) -> None:
    report = run_bench("training.py", tmp_path / "training.json")
    sequence = report["sequence"]
    layouts = [entry["layout"] for entry in sequence["layouts"]]
    assert len(layouts) == len(sequence["switches"]) + 1
    assert [(s["from"], s["to"]) for s in sequence["switches"]] == list(pairwise(layouts))
    assert all(entry["steps"] > 0 for entry in sequence["layouts"])
    assert math.isfinite(sequence["final_loss"])
    assert report["overhead"]["steps_while_preparing"] >= 1
    recoveries = report["recovery"]
    assert set(recoveries) == {"new process", "standing-by process"}
    for r in recoveries.values():
        assert r["lost"] == ["w1"] and r["step"] == 20
        assert r["pause_seconds"] > 0 and r["checkpoint_restart_seconds"] > 0


@pytest.mark.parametrize("per_pod", [1, 4])
def test_control_benchmark_quick(tmp_path: Path, per_pod: int) -> None:
    # The real operator over 8 simulated agents, in pods of `per_pod` (several: behind the pod's
    # proxy): started, shrunk by one pod and grown back, each change committed as a new epoch,
    # then a shrink aborted, without torch in the operator's process.
    report = run_bench("control.py", tmp_path / "control.json", "--members-per-pod", str(per_pod))
    (size,) = report["sizes"]
    assert size["members"] == 8 and size["members_per_pod"] == per_pod
    assert size["start"]["epoch"] < size["shrink"]["epoch"] < size["grow"]["epoch"]
    assert size["shrink"]["to"] == 8 - per_pod and size["grow"]["to"] == 8
    assert size["shrink"]["agent_calls"]["Release"] == 1  # the pod's members in one call
    assert size["grow"]["api_requests"]["POST"] == 1
    for change in (size["shrink"], size["grow"]):
        assert change["agent_calls"]["Prepare"] == 8 / per_pod  # one call a pod: all its members
        # The control is the total less the wait for the switch step (none when the members,
        # on a loaded machine, fell behind their clock).
        wait = change["step_boundary_wait_seconds"]
        control = pytest.approx(change["seconds"] - wait, abs=0.002)
        assert wait >= 0 and change["control_seconds"] == control
        assert wait > 0 or change["behind_the_clock_seconds"] > 0, change
        # The commit is recorded after the switch step; every member says it is prepared after
        # the last Prepare was taken (its answer reaches the operator moments later, at most).
        parts = change["parts_seconds"]
        assert parts["prepares_taken"] > 0 and parts["commit_seen"] > 0, parts
        assert parts["all_said_prepared"] > -0.5 and parts["prepares_obeyed"] > -0.5, parts
        # Each Prepare call timed: none took longer than the fan-out it was part of.
        spread = change["prepare_call_seconds"]
        assert 0 < spread["median"] <= spread["p90"] <= spread["max"], spread
        assert spread["max"] <= parts["prepares_taken"] + 0.01, (spread, parts)
        # Each pass timed in its stages, which make up most of it: the rest is the loop's.
        stages = change["pass_stage_seconds"]
        assert len(stages) == change["passes"] and stages[0]["observe"] > 0, stages
        for one in stages:
            within = one["observe"] + one["decide"] + one["act"]
            assert 0 < within <= one["seconds"] + 0.003, one
    # The same shrink again, which one member fails to prepare: recorded aborted, an Abort to
    # each member, every member's drop counted.
    abort = size["abort"]
    assert abort["epoch"] > size["grow"]["epoch"] and abort["to"] == 8 - per_pod
    assert abort["agent_calls"]["Abort"] == 8 and size["events"]["ReconfigurationAborted"] == 1
    assert abort["all_dropped_seconds"] > 0 and abort["took_the_prepare"] == 8, abort
    # One status call a pass for each pod: its members' statuses together.
    status = "GetStatus" if per_pod == 1 else "GetPodStatus"
    assert size["steady_pass"]["agent_calls_per_pass"] == {status: 8 / per_pod}
    # The machine's load in each phase: no more than its cores (the counters' granularity
    # aside); with no pass running, only the members' own steps.
    cores = os.cpu_count() or 1
    for phase in (size["start"], size["members_alone"], size["idle_loop"], size["shrink"],
                  size["grow"], size["abort"]):  # fmt: skip
        assert 0 <= phase["machine_busy_cores"] <= cores + 0.05, phase
    assert size["start"]["machine_busy_cores"] > 0
    assert size["members_alone"]["seconds"] > 0
    # With nothing to do, the loop passes every PERIOD: its own writes of the members' progress
    # wake it no sooner.
    idle = size["idle_loop"]
    assert 1 <= idle["passes"] <= idle["seconds"] / PERIOD + 1, idle


def test_store_benchmark_quick(tmp_path: Path) -> None:
    report = run_bench("store.py", tmp_path / "store.json")
    assert [r["members"] for r in report["rows"]] == [8, 32]
    for r in report["rows"]:
        for key in ("connect_seconds", "reverse_lookup_seconds"):
            assert 0 <= r[key]["median"] <= r[key]["max"]
        assert 0 <= r["reverse_lookups_failed"] <= r["members"]
    # Without --resolver-timeout the bench keeps the resolver it was given.
    assert report["resolver"]["RES_OPTIONS"] == os.environ.get("RES_OPTIONS", "")
    assert "torch" in report["machine"]


def test_moe_benchmark_quick(tmp_path: Path) -> None:
    # One member training the smallest mixture of experts: its step is timed and it learns.
    report = run_bench("moe.py", tmp_path / "moe.json")
    (row,) = report["models"]
    assert (row["experts"], row["top_k"], row["steps"]) == (8, 2, 4)
    assert row["step_seconds"] > 0 and row["tokens_per_second"] > 0
    assert math.isfinite(row["last_loss"])


def test_snapshots_benchmark_quick(tmp_path: Path) -> None:
    # The mirror's costs and a death each way: in memory from the mirrors at the step that broke
    # (or after it, killed after its update), against a restart from the checkpoint of step 10
    # (every 5 steps, the kill at 12).
    report = run_bench("snapshots.py", tmp_path / "snapshots.json")
    held = report["member_state_bytes"]
    assert held["held once"] < held["mirrored"] < 2 * held["held once"]
    assert all(v > 0 for v in report["step_seconds"]["runs"]["dp=4,zero=1,mirror=1"])
    update = report["optimizer_update_seconds"]
    assert update["held once"] > 0 and update["mirrored"] > 0
    mirrored, unshared, restarted = report["member_killed"].values()
    assert (mirrored["recovery"], mirrored["resumed_at_step"]) == ("in memory", 12)
    # Killed after step 12's update: the step stands. A recovery from ZeRO-1 reads parameters
    # from their shard's holders wherever the member died: the same bytes either way.
    assert (unshared["recovery"], unshared["resumed_at_step"]) == ("in memory", 13)
    assert unshared["steps_trained_again"] == 0
    assert unshared["recovery_network_bytes"] == mirrored["recovery_network_bytes"] > 0
    assert mirrored["steps_trained_again"] == 0 and mirrored["recovery_switch_seconds"]["pause"] > 0
    assert (restarted["recovery"], restarted["resumed_at_step"]) == ("checkpoint restore", 10)
    assert restarted["steps_trained_again"] == 2
    # From step 12 on, both jobs train the same steps on the same state.
    assert mirrored["losses_after"][0] == restarted["losses_after"][2]
    assert unshared["losses_after"][0] == mirrored["losses_after"][1]


def test_pod_proxy_benchmark_quick(tmp_path: Path) -> None:
    # The same member answers both ways; only the pod's supervisor stamps its certificate.
    report = run_bench("pod_proxy.py", tmp_path / "pod-proxy.json")
    direct, proxied = report["direct"], report["proxied"]
    assert direct["step"] == proxied["step"] == 12345
    assert direct["serving_certificate"] == "" and len(proxied["serving_certificate"]) == 64
    for timing in (direct, proxied):
        assert 0 < timing["median_ms"] <= timing["p99_ms"]
        assert timing["calls_per_second_16_threads"] > 0
    pod = report["pod"]
    assert pod["members"] == 8
    for way in ("per_member", "pod_call"):
        assert 0 < pod[f"{way}_median_ms"] <= pod[f"{way}_p99_ms"]


def test_the_control_benchmarks_farms_write_their_threads_stacks_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a control run that does not end shows of its agents (`Farms.dump_stacks`)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the farm's process imports it too
    import control

    farms = control.Farms(members=1, step_seconds=1.0, per_pod=1)
    try:
        farms.agreed()  # the farm serves (its handler is registered before that)
        (written,) = farms.dump_stacks()
        text = written.read_text()
        assert "Thread 'MainThread'" in text and "control_agents.py" in text
        assert "in serve_farm" in text
    finally:
        farms.close()
    assert written.exists()  # the farms' end keeps it
    written.unlink()
