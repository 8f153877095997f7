"""Readiness, liveness and startup probes of one container (exec, tcpSocket, httpGet), evaluated
as the kubelet does: initial delay, period, timeout, success and failure thresholds.

A probe is run synchronously by the pod's worker when it is due (bounded by its timeout); a
container without a readiness probe is ready while it runs.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)


def _port(value: int | str, container: Mapping[str, Any]) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"container {container.get('name')!r} has no port named {value!r}")


def run_probe(
    probe: Mapping[str, Any],
    container: Mapping[str, Any],
    pod_ip: str,
    env: dict[str, str],
    wrap: Callable[[list[str]], list[str]] = list,
) -> bool:
    """One probe attempt; True on success. An exec probe's command is run as ``wrap`` makes
    it (in the pod's network namespace, where it has one)."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "exec" in probe:
            result = subprocess.run(
                wrap(list(probe["exec"]["command"])),
                env=env,
                timeout=timeout,
                check=False,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            return result.returncode == 0
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            host = spec.get("host") or pod_ip
            with socket.create_connection((host, _port(spec["port"], container)), timeout):
                return True
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host = spec.get("host") or pod_ip
            scheme = str(spec.get("scheme", "HTTP")).lower()
            url = f"{scheme}://{host}:{_port(spec['port'], container)}{spec.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
            request = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return bool(200 <= resp.status < 400)
    except (OSError, ValueError, subprocess.TimeoutExpired, urllib.error.URLError):
        return False
    log.warning("unsupported probe %s", sorted(probe))
    return True


class ProbeState:
    """The running verdict of one probe over successive attempts."""

    def __init__(self, probe: Mapping[str, Any] | None, initially: bool) -> None:
        self.probe = probe
        self.initially = initially
        self.reset(time.monotonic())

    def reset(self, started: float) -> None:
        """A (re)started container: the verdict starts over."""
        self.ok = self.initially if self.probe else True
        self._successes = 0
        self._failures = 0
        delay = float((self.probe or {}).get("initialDelaySeconds") or 0)
        self._next = started + delay

    @property
    def failed(self) -> bool:
        """The failure threshold has been reached (for liveness and startup probes)."""
        threshold = int((self.probe or {}).get("failureThreshold") or 3)
        return self.probe is not None and self._failures >= threshold

    def due(self, now: float) -> bool:
        return self.probe is not None and now >= self._next

    def record(self, success: bool, now: float) -> bool:
        """Counts an attempt; True when the verdict changed."""
        assert self.probe is not None
        self._next = now + float(self.probe.get("periodSeconds") or 10)
        before = self.ok
        if success:
            self._successes += 1
            self._failures = 0
            if self._successes >= int(self.probe.get("successThreshold") or 1):
                self.ok = True
        else:
            self._failures += 1
            self._successes = 0
            if self._failures >= int(self.probe.get("failureThreshold") or 3):
                self.ok = False
        return self.ok != before
