"""One container as a local process group: start, signal, exit and restart bookkeeping, and the
``containerStatuses`` entry that describes it. Knows nothing about the API server."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from liveshard_e2e.kubelet.probes import ProbeState
from liveshard_e2e.procs import process_start_time, spawn

log = logging.getLogger(__name__)

BACKOFF_START = 1.0
BACKOFF_MAX = 20.0
BACKOFF_RESET_AFTER = 10.0  # a run this long resets the crash-loop back-off
# A termination message taken from the log is at most this long, as the kubelet's is.
MESSAGE_LINES, MESSAGE_BYTES = 80, 2048


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Container:
    """The runtime state of one container of one pod (driven by the pod's worker thread)."""

    def __init__(self, spec: dict[str, Any], pod_dir: Path, pids_dir: Path, *, init: bool) -> None:
        self.spec = spec
        self._pids_dir = pids_dir
        self.name: str = spec["name"]
        self.init = init
        self.log_path = pod_dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restart_count = 0
        self.started_at = ""
        self.started_mono = 0.0
        self.last_terminated: dict[str, Any] | None = None
        self.terminated: dict[str, Any] | None = None
        self.waiting = ("ContainerCreating", "")
        self.next_start = 0.0
        self.backoff = BACKOFF_START
        self.stopping = False  # SIGTERM sent by the kubelet
        self.env: dict[str, str] = {}
        self.startup = ProbeState(spec.get("startupProbe"), initially=False)
        self.liveness = ProbeState(spec.get("livenessProbe"), initially=True)
        self.readiness = ProbeState(spec.get("readinessProbe"), initially=False)

    @property
    def running(self) -> bool:
        return self.proc is not None

    @property
    def ready(self) -> bool:
        """Running, started (startup probe) and passing its readiness probe, if any."""
        return self.running and not self.init and self.startup.ok and self.readiness.ok

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        """Starts the process group; the previous run's log becomes ``<name>.previous.log``."""
        if self.log_path.exists() and self.restart_count:
            self.log_path.replace(self.log_path.with_suffix(".previous.log"))
        # An image's WORKDIR has no equivalent; the pod's own folder is the neutral default.
        cwd = self.spec.get("workingDir") or None
        if not cwd or not Path(cwd).is_dir():
            cwd = str(self.log_path.parent)
        self.proc = spawn(argv, self.log_path, env=env, cwd=cwd)
        # Record the group so `liveshard-cluster down` can end it even if the kubelet died.
        self._pids_dir.mkdir(parents=True, exist_ok=True)
        start_time = process_start_time(self.proc.pid)
        (self._pids_dir / str(self.proc.pid)).write_text(f"{start_time}\n")
        self.started_at = now_rfc3339()
        self.started_mono = time.monotonic()
        self.env = env
        for probe in (self.startup, self.liveness, self.readiness):
            probe.reset(self.started_mono)
        self.terminated = None
        self.waiting = ("", "")
        self.stopping = False
        log.info("container %s started: pid %d %s", self.name, self.proc.pid, argv)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def poll(self) -> bool:
        """Reaps an exited process; True when it just exited."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N
        # The group ends with its leader, as a container's processes end with its PID 1.
        self.signal(signal.SIGKILL)
        (self._pids_dir / str(self.proc.pid)).unlink(missing_ok=True)
        reason = "Completed" if exit_code == 0 else "Error"
        if self.stopping and code == -signal.SIGKILL:
            reason = "Error"
        self.terminated = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": self.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"process://{self.proc.pid}",
        }
        if code < 0:
            self.terminated["signal"] = -code
        if exit_code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            self.terminated["message"] = self._log_tail()
        ran = time.monotonic() - self.started_mono
        self.backoff = BACKOFF_START if ran > BACKOFF_RESET_AFTER else self.backoff
        log.info("container %s pid %d exited with %d", self.name, self.proc.pid, exit_code)
        self.proc = None
        return True

    def _log_tail(self) -> str:
        """The end of this run's log, as the kubelet's FallbackToLogsOnError keeps it (the
        container has no filesystem of its own for a terminationMessagePath here)."""
        try:
            with self.log_path.open("rb") as log_file:
                log_file.seek(0, os.SEEK_END)
                log_file.seek(max(log_file.tell() - MESSAGE_BYTES, 0))
                tail = log_file.read()
        except OSError:
            return ""
        return "\n".join(tail.decode(errors="replace").splitlines()[-MESSAGE_LINES:])

    def schedule_restart(self) -> None:
        """Counts a restart and waits out the crash-loop back-off before the next start."""
        self.last_terminated = self.terminated
        self.terminated = None
        self.restart_count += 1
        self.next_start = time.monotonic() + self.backoff
        self.waiting = (
            "CrashLoopBackOff",
            f"back-off {self.backoff:.0f}s restarting failed container",
        )
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def status(self) -> dict[str, Any]:
        """This container's entry in ``status.containerStatuses``."""
        entry: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image") or "process",
            "imageID": "",
            "restartCount": self.restart_count,
            "ready": self.ready,
            "started": self.running and self.startup.ok,
        }
        if self.proc is not None:
            entry["containerID"] = f"process://{self.proc.pid}"
            entry["state"] = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None:
            entry["containerID"] = self.terminated["containerID"]
            entry["state"] = {"terminated": self.terminated}
        else:
            reason, message = self.waiting
            waiting = {"reason": reason or "ContainerCreating"}
            if message:
                waiting["message"] = message
            entry["state"] = {"waiting": waiting}
        entry["lastState"] = {"terminated": self.last_terminated} if self.last_terminated else {}
        return entry
