"""The operator's API client against a real HTTP server: a rotated service-account token is
presented from the next request on; a throttled request is sent again."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from liveshard_operator import kube
from liveshard_operator.kube import ApiError, JsonApi


class Quiet(BaseHTTPRequestHandler):
    """A handler that logs nothing and answers with `answer`."""

    def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering `{}` to every GET; the Authorization headers it saw."""
    seen: list[str] = []

    class Handler(Quiet):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            self.answer(200, json.dumps({}).encode())

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


def test_a_throttled_request_is_sent_again_after_its_retry_after_and_then_fails() -> None:
    """An API server that throttles `/busy` twice and `/full` always (429, Retry-After: 0)."""
    sent: list[str] = []

    class Handler(Quiet):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            sent.append(self.path)
            if self.path == "/full" or sent.count(self.path) <= 2:
                self.answer(429, b'{"reason": "TooManyRequests"}', {"Retry-After": "0"})
            else:
                self.answer(201, b'{"made": true}')

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        api = JsonApi(f"http://127.0.0.1:{httpd.server_port}")
        assert api.request("POST", "/busy", {"a": 1}) == {"made": True}
        with pytest.raises(ApiError) as err:
            api.request("POST", "/full", {"a": 1})
        assert err.value.status == 429
        assert sent == ["/busy"] * 3 + ["/full"] * kube.THROTTLED_TRIES
    finally:
        httpd.shutdown()
        httpd.server_close()
