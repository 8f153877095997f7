"""The operator's API client against a real HTTP server: a rotated service-account token is
presented from the next request on; a throttled request raises `Throttled` with the wait the
server asks for; a server that cannot be reached or does not answer in time raises an `OSError`;
a read whose pooled connection the server dropped is sent again, a write is not."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from liveshard_operator.kube import JsonApi, Throttled


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering `{}` to every GET, but 429 under /throttled (with the rest of the
    path as its Retry-After, if any); the Authorization headers it saw."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({}).encode()
            throttled, _, after = self.path.removeprefix("/").partition("/")
            self.send_response(429 if throttled == "throttled" else 200)
            if after:
                self.send_header("Retry-After", after)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}", seen
    httpd.shutdown()
    httpd.server_close()


def test_a_rotated_token_file_is_read_again(server: tuple[str, list[str]], tmp_path: Path) -> None:
    url, seen = server
    token = tmp_path / "token"
    token.write_text("first-token\n")
    api = JsonApi(url, token="ignored-once-the-file-is-read", token_file=str(token))
    api.request("GET", "/api")
    api.request("GET", "/api")
    # The kubelet swaps the file atomically (a new inode), with a token of the same length.
    rotated = tmp_path / "token.new"
    rotated.write_text("other-token\n")
    os.replace(rotated, token)
    api.request("GET", "/api")
    token.unlink()  # unreadable: the last token read stays
    api.request("GET", "/api")
    assert seen == ["Bearer first-token"] * 2 + ["Bearer other-token"] * 2


def test_without_a_token_file_the_given_token_is_presented(server: tuple[str, list[str]]) -> None:
    url, seen = server
    JsonApi(url, token="static").request("GET", "/api")
    assert seen == ["Bearer static"]


def test_a_throttled_request_raises_with_the_wait_asked(server: tuple[str, list[str]]) -> None:
    url, _ = server
    api = JsonApi(url, token="static")
    for path, wait in (("/throttled/3", 3.0), ("/throttled", 1.0), ("/throttled/soon", 1.0)):
        with pytest.raises(Throttled) as caught:
            api.request("GET", path)
        assert (caught.value.status, caught.value.retry_after) == (429, wait)
        assert (caught.value.method, caught.value.path) == ("GET", path)


def test_an_unreachable_or_silent_server_raises_an_os_error() -> None:
    """As a socket's own errors: what the leader election and the kubelet retry on."""
    with socket.socket() as silent:  # accepts connections (its backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(TimeoutError, match="GET /api: no answer in time"):
            JsonApi(f"http://127.0.0.1:{port}").request("GET", "/api", timeout=0.2)
    # Closed now: nothing listens on the port.
    with pytest.raises(ConnectionError, match="GET /api: "):
        JsonApi(f"http://127.0.0.1:{port}").request("GET", "/api", timeout=2)


def test_a_read_on_a_connection_dropped_under_it_is_sent_again() -> None:
    """The server keeps each connection open after its first answer and drops it, unanswered,
    on its next request: as an API server or a balancer closing an idle keep-alive connection
    just as the client reuses it."""
    answered: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client pools the connection
        served = False  # on this connection

        def _answer(self) -> None:
            if self.served:
                self.close_connection = True  # dropped without an answer
                return
            self.served = True
            answered.append(self.command)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps({"n": len(answered)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        api = JsonApi(f"http://127.0.0.1:{httpd.server_port}", pool_size=1)
        assert api.request("GET", "/api") == {"n": 1}
        assert api.request("GET", "/api") == {"n": 2}  # dropped, then sent on a new connection
        with pytest.raises(ConnectionError, match="POST /api: "):  # dropped: not sent again
            api.request("POST", "/api", {})
        assert answered == ["GET", "GET"]
    finally:
        httpd.shutdown()
        httpd.server_close()
