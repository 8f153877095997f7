"""Starting and stopping the cluster's local processes by recorded id, never by name.

A process is recorded as its pid plus its kernel start time (``/proc/<pid>/stat`` field 22), so a
recycled pid is never mistaken for ours. Each process leads its own process group, and stopping
signals the whole group: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessRecord:
    """A process we started: enough to find it again safely."""

    name: str
    pid: int
    start_time: int
    log_file: str

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "pid": self.pid,
            "start_time": self.start_time,
            "log_file": self.log_file,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ProcessRecord:
        return cls(
            name=str(data["name"]),
            pid=int(str(data["pid"])),
            start_time=int(str(data["start_time"])),
            log_file=str(data["log_file"]),
        )


def process_start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` in clock ticks, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited already
        return None
    return int(fields[19])


def is_alive(record: ProcessRecord) -> bool:
    """Whether the recorded process still runs (same pid and same start time)."""
    return process_start_time(record.pid) == record.start_time


def spawn(
    argv: list[str],
    log_file: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.Popen[bytes]:
    """Starts ``argv`` leading a new session; stdout and stderr are appended to ``log_file``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def start(
    name: str,
    argv: list[str],
    log_file: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """`spawn` a long-running process and record it; fails if it exits at once."""
    proc = spawn(argv, log_file, env=env, cwd=cwd)
    start_time = process_start_time(proc.pid)
    if start_time is None:
        proc.wait()
        raise RuntimeError(
            f"{name} exited at once with status {proc.returncode}; see {log_file}:\n"
            + tail(log_file)
        )
    log.info("started %s pid %d: %s", name, proc.pid, " ".join(argv))
    return proc, ProcessRecord(name, proc.pid, start_time, str(log_file))


def stop(record: ProcessRecord, grace_seconds: float = 10.0) -> None:
    """SIGTERM to the recorded process group, then SIGKILL after ``grace_seconds``."""
    if not is_alive(record):
        return
    log.info("stopping %s pid %d", record.name, record.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        _reap(record.pid)
        if not is_alive(record):
            return
        time.sleep(0.1)
    log.warning(
        "%s pid %d ignored SIGTERM for %.0f s; killing", record.name, record.pid, grace_seconds
    )
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while is_alive(record) and time.monotonic() < deadline:
        _reap(record.pid)
        time.sleep(0.05)


def _reap(pid: int) -> None:
    """Collects our own exited child so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_BELOW = 8192  # how many ports below the ephemeral range `free_port` picks from
_given: set[int] = set()  # never handed out twice by this process: a caller may not bind it yet
# A port given is claimed for the giving process's life: a lock on the file's byte at that offset,
# which the kernel drops when the process ends, so no other process of this user gives it too.
CLAIMS = Path(tempfile.gettempdir()) / f"liveshard-ports-{os.getuid()}"
_claims: dict[Path, int] = {}  # the file's descriptor, opened once (closing one drops its locks)


def _claim(port: int) -> bool:
    """Whether `port` is now this process's: no other live process claimed it (where the claims
    file cannot be opened, every port is)."""
    try:
        fd = _claims.get(CLAIMS)
        if fd is None:
            fd = _claims[CLAIMS] = os.open(CLAIMS, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:  # another process holds it
        return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, taken at random below the kernel's
    ephemeral range, where every connect and every bind to port 0 takes its port: no other
    process's connection can take it before the server it is for binds it (where the range
    leaves no room below it, a port the kernel gives). A port is never given twice: not by one
    process, nor by two of one user's processes alive at once (`CLAIMS`), so two callers never
    get the same one before either binds it."""
    try:
        low = int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = [random.randrange(low - _BELOW, low) for _ in range(64)] if low > _BELOW else []
    for port in candidates:
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # bound, or in TIME_WAIT: another
                continue
            if not _claim(port):
                continue
            _given.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tail(path: Path | str, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"
    return "\n".join(text.splitlines()[-lines:])
