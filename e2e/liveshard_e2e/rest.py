"""A minimal Kubernetes REST client over JSON dicts, for the process kubelet and the tests.

The kubelet handles pods as the API's plain JSON (it reads fields the typed models rename and
patches status with strategic-merge patches), so it talks HTTP directly with the credentials
of a kubeconfig this project wrote itself (server, CA file, client cert and key, or a token).
The requests themselves are the operator's (`liveshard_operator.kube.JsonApi`): one piece of
code makes a JSON request in the product and in the harness; the harness adds what only it
needs (kubeconfig files, text answers, watches). The product never imports the harness.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml
from liveshard_operator.kube import MERGE, ApiError, JsonApi, unreachable

__all__ = ["MERGE", "STRATEGIC", "ApiError", "Rest"]

log = logging.getLogger(__name__)

STRATEGIC = "application/strategic-merge-patch+json"


class Rest(JsonApi):
    """Requests with the identity of a kubeconfig this project wrote; safe to share between
    threads."""

    def __init__(self, kubeconfig: Path | str, pool_size: int = 16) -> None:
        config = yaml.safe_load(Path(kubeconfig).read_text())
        current = config["current-context"]
        context = next(c["context"] for c in config["contexts"] if c["name"] == current)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        super().__init__(
            str(cluster["server"]), token=user.get("token"),
            ca_file=cluster["certificate-authority"], cert_file=user.get("client-certificate"),
            key_file=user.get("client-key"), pool_size=pool_size, timeout=30.0,
        )  # fmt: skip

    def get_text(self, path: str) -> str:
        """A GET whose answer is text (``/readyz``, ``/version`` is JSON but fine too)."""
        resp = self.pool.request("GET", self.server + path, headers=self.headers, timeout=10)
        text = resp.data.decode(errors="replace")
        if resp.status != 200:
            raise ApiError("GET", path, resp.status, text)
        return text

    def get(self, path: str, **query: Any) -> Any:
        return self.request("GET", path, query=query or None)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any, content_type: str = STRATEGIC) -> Any:
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 240, **query: Any
    ) -> Iterator[dict[str, Any]]:
        """Watch events from ``resource_version``; ends when the server closes the stream.
        An ERROR event (410 Gone among them) is raised as :class:`ApiError`; a connection that
        fails or goes silent, as the `OSError` a request raises (`unreachable`)."""
        try:
            yield from self._watch(path, resource_version, timeout_seconds, **query)
        except urllib3.exceptions.HTTPError as err:
            raise unreachable("WATCH", path, err) from err

    def _watch(
        self, path: str, resource_version: str, timeout_seconds: int, **query: Any
    ) -> Iterator[dict[str, Any]]:
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout_seconds,
            "allowWatchBookmarks": "true",
            **query,
        }
        url = f"{self.server}{path}?{urlencode(params)}"
        resp = self.pool.request(
            "GET",
            url,
            headers=self.headers,
            preload_content=False,
            timeout=urllib3.Timeout(connect=10, read=timeout_seconds + 30),
        )
        try:
            if resp.status != 200:
                raise ApiError("WATCH", path, resp.status, resp.read().decode(errors="replace"))
            buffer = b""
            for chunk in resp.stream(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        obj = event["object"]
                        raise ApiError("WATCH", path, int(obj.get("code", 500)), json.dumps(obj))
                    yield event
        finally:
            resp.release_conn()
