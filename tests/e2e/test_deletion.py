"""Graceful pod deletion on the process kubelet: preStop, SIGTERM, SIGKILL at the grace
deadline, then the pod object is removed. Needs the local cluster."""

from __future__ import annotations

import os
from pathlib import Path

from liveshard_e2e.procs import process_start_time
from liveshard_e2e.testing import Kube, python_pod, running
from liveshard_e2e.waiting import wait_until

HANDLES_TERM = """
import signal, sys, time
def on_term(signum, frame):
    open(sys.argv[1], "w").write("SIGTERM handled")
    print("got SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("waiting", flush=True)
while True:
    time.sleep(0.1)
"""

IGNORES_TERM = """
import signal, sys, time
def on_term(signum, frame):
    open(sys.argv[1], "w").write("SIGTERM ignored")
signal.signal(signal.SIGTERM, on_term)
print("waiting", flush=True)
while True:
    time.sleep(0.1)
"""


def _pid(pod: dict) -> int:  # type: ignore[type-arg]
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    return int(container_id.removeprefix("process://"))


def _python(code: str, marker: Path) -> dict:  # type: ignore[type-arg]
    return {"command": ["python", "-u", "-c", code, str(marker)]}


def test_sigterm_handler_runs_and_pod_goes(kube: Kube, tmp_path: Path) -> None:
    marker = tmp_path / "term"
    kube.apply(python_pod("polite", "", container=_python(HANDLES_TERM, marker)))
    pod = kube.wait_pod("polite", running, "Running")
    wait_until(lambda: "waiting" in kube.logs("polite"), 30, "the handler to be installed")
    pid = _pid(pod)
    kube.kubectl("delete", "pod", "polite", "--grace-period=30", "--wait=false")
    kube.wait_pod_gone("polite", timeout=25)  # well before the 30 s deadline: it exited
    assert marker.read_text() == "SIGTERM handled"
    assert process_start_time(pid) is None


def test_ignored_sigterm_is_killed_at_deadline_after_prestop(kube: Kube, tmp_path: Path) -> None:
    marker = tmp_path / "term"
    prestop = tmp_path / "prestop"
    container = _python(IGNORES_TERM, marker)
    # The hook runs in the container: with its environment, the kubelet's part of it too.
    hook = (
        f"import os; open({str(prestop)!r}, 'w').write(os.environ['HOSTNAME'] + os.environ['MARK'])"
    )
    container["lifecycle"] = {"preStop": {"exec": {"command": ["python", "-c", hook]}}}
    container["env"] = [{"name": "MARK", "value": " from the spec"}]
    kube.apply(python_pod("stubborn", "", container=container, terminationGracePeriodSeconds=60))
    pod = kube.wait_pod("stubborn", running, "Running")
    wait_until(lambda: "waiting" in kube.logs("stubborn"), 30, "the handler to be installed")
    pid = _pid(pod)
    kube.kubectl("delete", "pod", "stubborn", "--grace-period=3", "--wait=false")
    wait_until(marker.exists, 15, "SIGTERM to reach the process")
    assert prestop.read_text() == "stubborn from the spec", "the preStop hook runs before SIGTERM"
    assert marker.read_text() == "SIGTERM ignored"
    kube.wait_pod_gone("stubborn", timeout=30)
    assert process_start_time(pid) is None, f"pid {pid} survived the grace deadline"


def test_force_delete_kills_at_once(kube: Kube) -> None:
    kube.apply(python_pod("forced", "import time; time.sleep(3600)"))
    pid = _pid(kube.wait_pod("forced", running, "Running"))
    kube.kubectl("delete", "pod", "forced", "--grace-period=0", "--force")
    wait_until(lambda: process_start_time(pid) is None, 15, f"pid {pid} to be killed")
    assert not os.path.exists(f"/proc/{pid}/cmdline") or process_start_time(pid) is None
