"""The harness's own parts (no cluster needed): its bounded waits (the value awaited, a timeout
naming what was awaited and what was last seen, the trace a run asks for with
LIVESHARD_E2E_TRACE), the free ports its servers take (never the same to two processes) and its
watches' errors (a dropped stream is an `OSError`, as a request's, which the kubelet retries on)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from liveshard_e2e import procs
from liveshard_e2e.rest import ApiError, Rest
from liveshard_e2e.waiting import wait_until


def test_a_wait_returns_the_value_fails_naming_what_and_traces_each_wait_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "waits.log"
    monkeypatch.setenv("LIVESHARD_E2E_TRACE", str(trace))
    answers = iter([None, 0, "ready"])
    assert wait_until(lambda: next(answers), 5, "the thing", interval=0.01) == "ready"
    with pytest.raises(TimeoutError, match="waiting for never; last state: still not"):
        wait_until(lambda: None, 0.05, "never", interval=0.01, describe=lambda: "still not")
    first, second = trace.read_text().splitlines()
    assert "test_harness.py::test_a_wait_returns" in first and first.endswith(" s the thing")
    assert second.endswith(" s never (timed out)")
    monkeypatch.delenv("LIVESHARD_E2E_TRACE")
    wait_until(lambda: True, 1, "untraced")
    assert len(trace.read_text().splitlines()) == 2


def test_free_ports_are_taken_below_the_ephemeral_range_where_it_leaves_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(procs, "EPHEMERAL", ranges)
    monkeypatch.setattr(procs, "_given", set())
    ranges.write_text("40000\t60999\n")
    # None is bound here, yet none is given twice (300 draws of 8192 would repeat one).
    drawn = [procs.free_port() for _ in range(300)]
    assert all(40000 - 8192 <= p < 40000 for p in drawn) and len(set(drawn)) == len(drawn)
    ports = set(drawn)
    # One bound meanwhile is never given.
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.pop()))
        taken = held.getsockname()[1]
        assert taken not in {procs.free_port() for _ in range(200)}
    ranges.write_text("1024\t60999\n")  # no room below: the kernel's choice
    assert 1024 <= procs.free_port() <= 65535


_CLAIMANT = """
import sys
from pathlib import Path
from liveshard_e2e import procs
procs.CLAIMS = Path(sys.argv[1])
print(procs._claim(int(sys.argv[2])), flush=True)
sys.stdin.read()
"""


def test_a_port_another_live_process_was_given_is_not_given_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A port below the machine's ephemeral range, which no connection takes meanwhile (one in it
    # may be any connection's own), and claimed for this process's life among the user's others.
    claims, port = tmp_path / "claims", procs.free_port()
    monkeypatch.setattr(procs, "CLAIMS", claims)
    monkeypatch.setattr(procs, "_claims", {})
    monkeypatch.setattr(procs, "_given", set())
    monkeypatch.setattr(procs, "EPHEMERAL", tmp_path / "ip_local_port_range")
    procs.EPHEMERAL.write_text("40000\t60999\n")
    monkeypatch.setattr(procs.random, "randrange", lambda *_: port)  # every draw is `port`
    other = subprocess.Popen(
        [sys.executable, "-c", _CLAIMANT, str(claims), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "True"
        assert procs.free_port() != port  # the other's: the kernel's choice instead
    finally:
        other.communicate("")
    assert procs.free_port() == port  # free again once the other ended


def test_a_watch_yields_events_and_raises_a_dropped_stream_as_a_connection_error(
    tmp_path: Path,
) -> None:
    """The server streams one event and then an ERROR event (under /gone) or drops the
    connection in the middle of its chunked answer (under /dropped)."""
    added = json.dumps({"type": "ADDED", "object": {"kind": "Pod"}}).encode() + b"\n"
    gone = json.dumps({"type": "ERROR", "object": {"code": 410, "reason": "Expired"}}).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(added), added))
            if self.path.startswith("/gone"):
                self.wfile.write(b"%x\r\n%s\n\r\n0\r\n\r\n" % (len(gone) + 1, gone))
            else:
                self.wfile.write(b"ff\r\n{")  # a chunk cut short
                self.close_connection = True
            self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {
            "server": f"http://127.0.0.1:{httpd.server_port}",
            "certificate-authority": str(tmp_path / "unused-ca.crt"),
        }}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    }))  # fmt: skip
    try:
        rest = Rest(kubeconfig)
        events = rest.watch("/dropped", "1")
        assert next(events)["type"] == "ADDED"
        with pytest.raises(ConnectionError, match="WATCH /dropped: "):
            next(events)
        events = rest.watch("/gone", "1")
        assert next(events)["type"] == "ADDED"
        with pytest.raises(ApiError) as caught:
            next(events)
        assert (caught.value.status, caught.value.reason) == (410, "Expired")
    finally:
        httpd.shutdown()
        httpd.server_close()
