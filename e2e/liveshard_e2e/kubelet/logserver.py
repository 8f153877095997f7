"""The kubelet's log endpoint, so that ``kubectl logs`` works through the API server.

The API server dials the node's InternalIP and ``daemonEndpoints.kubeletEndpoint.Port`` over TLS
(verified against the cluster CA) for ``/containerLogs/<namespace>/<pod>/<container>``; this
serves those paths from the files the containers write. Only the log paths exist.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

log = logging.getLogger(__name__)


def find_log(
    pods_dir: Path, namespace: str, pod: str, container: str, previous: bool
) -> Path | None:
    """The newest log file of ``container`` in the newest pod of that name."""
    dirs = sorted(pods_dir.glob(f"{namespace}_{pod}_*"), key=lambda p: p.stat().st_mtime)
    if not dirs:
        return None
    name = f"{container}.previous.log" if previous else f"{container}.log"
    path = dirs[-1] / name
    return path if path.exists() else None


def default_container(pods_dir: Path, namespace: str, pod: str) -> str | None:
    dirs = sorted(pods_dir.glob(f"{namespace}_{pod}_*"), key=lambda p: p.stat().st_mtime)
    if not dirs:
        return None
    logs = sorted(
        p.name[: -len(".log")] for p in dirs[-1].glob("*.log") if ".previous." not in p.name
    )
    return logs[0] if len(logs) == 1 else None


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


class _Handler(BaseHTTPRequestHandler):
    server: LogServer

    def log_message(self, format: str, *args: object) -> None:
        log.debug("log server: " + format, *args)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> is served")
            return
        _, namespace, pod, container = parts
        query = parse_qs(url.query)
        previous = query.get("previous", ["false"])[0] == "true"
        path = find_log(self.server.pods_dir, namespace, pod, container, previous)
        if path is None:
            self.send_error(404, f"no log for container {container!r} of pod {namespace}/{pod}")
            return
        data = path.read_bytes()
        if "tailLines" in query:
            data = _tail(data, int(query["tailLines"][0]))
        if "limitBytes" in query:
            data = data[: int(query["limitBytes"][0])]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        follow = query.get("follow", ["false"])[0] == "true"
        if not follow:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        offset = path.stat().st_size
        done = path.parent / ".done"
        try:
            while True:
                size = path.stat().st_size if path.exists() else offset
                if size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read(size - offset)
                    offset = size
                    self.wfile.write(chunk)
                    self.wfile.flush()
                elif done.exists() or not path.exists():
                    return
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            return


class LogServer(ThreadingHTTPServer):
    """HTTPS on 127.0.0.1:<port> serving container logs from ``pods_dir``."""

    daemon_threads = True

    def __init__(self, port: int, cert: str, key: str, pods_dir: Path) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.pods_dir = pods_dir
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.socket = context.wrap_socket(self.socket, server_side=True)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="log-server", daemon=True)
        thread.start()
        return thread
