"""`bench/plan.py --quick` runs end to end and reports every kind of row (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan.py"), "--quick", "--repeat", "1",
         "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    kinds = {r["kind"] for r in rows}
    assert kinds == {"plan", "member", "assign", "policy", "pods"}
    for r in rows:
        if r["kind"] == "member":
            assert r["checked"] and r["rounds"] > 0  # equal to the whole schedule's part
        if r["kind"] == "assign":
            assert r["lower_bound_bytes"] <= r["best_network_bytes"] <= r["ordered_network_bytes"]
        if r["kind"] == "plan":
            assert r["network_bytes"] > 0 and r["rounds"] > 0
        if r["kind"] == "pods":  # the pods choose only the senders
            assert r["across_pods_bytes_pods"] <= r["across_pods_bytes_ignoring_pods"]
            assert r["across_pods_bytes_ignoring_pods"] <= r["network_bytes"]
