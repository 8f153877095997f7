"""The operator's Kubernetes API access: JSON requests with the operator's own identity.

Objects are handled as the API's plain JSON (the typed models rename fields). Credentials come from
`kubernetes.config`: the kubeconfig that `KUBECONFIG` names, or the pod's service account in a
cluster, whose token the kubelet rotates: it is read from its file again whenever the file
changes, so a long-running operator never presents an expired token. kopf keeps its own
connection for watching; this one is for the controller's reads and writes from its thread.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from .render import GROUP, PLURAL, VERSION

MERGE = "application/merge-patch+json"
# Posts a Kubernetes Event on a job: (job, type, reason, message).
Events = Callable[[dict[str, Any], str, str, str], None]
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # kubelet rotates it


class ApiError(RuntimeError):
    """A non-2xx answer from the API server; `reason` is the Status object's, when it has one."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.method, self.path, self.status = method, path, status
        self.body = body
        try:
            self.reason = str(json.loads(body).get("reason", ""))
        except (ValueError, AttributeError):
            self.reason = ""
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")


class Stale(ApiError):
    """A 409 on a write conditional on a resourceVersion: the object changed since it was read."""


class Throttled(ApiError):
    """A 429: the API server's priority and fairness queues are full; it asks for no request
    before `retry_after` seconds (its Retry-After header; 1 s when it gives none)."""

    def __init__(self, method: str, path: str, body: str, retry_after: str | None) -> None:
        super().__init__(method, path, 429, body)
        try:
            self.retry_after = max(float(retry_after or 1), 0.0)
        except ValueError:  # an HTTP date, which the API server does not send
            self.retry_after = 1.0


def unreachable(method: str, path: str, err: urllib3.exceptions.HTTPError) -> OSError:
    """urllib3's error as the `OSError` a socket would raise: `TimeoutError` when the API server
    did not answer in time, else `ConnectionError` (urllib3 makes a refused connection a kind of
    its connect timeout)."""
    late = isinstance(err, urllib3.exceptions.TimeoutError) and not isinstance(
        err, urllib3.exceptions.NewConnectionError
    )
    if late:
        return TimeoutError(f"{method} {path}: no answer in time: {err}")
    return ConnectionError(f"{method} {path}: {err}")


class JsonApi:
    """JSON requests against one API server with one identity; safe to share between threads.
    The local cluster's harness (`liveshard_e2e.rest`) makes its requests with this class too."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        token_file: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        verify: bool = True,
        pool_size: int = 8,
        timeout: float = 15.0,
    ) -> None:
        self.server = server.rstrip("/")
        self.timeout = timeout
        self.headers = {"Accept": "application/json"}
        if token:
            self.headers["Authorization"] = (
                token if token.startswith("Bearer") else f"Bearer {token}"
            )
        self.token_file = token_file  # read again when it changes (a rotated token)
        self._token_read: tuple[int, int, int] | None = (
            None  # the file when read: mtime, inode, size
        )
        self._token_lock = threading.Lock()
        self.pool = urllib3.PoolManager(
            maxsize=pool_size,
            ca_certs=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            cert_reqs="CERT_REQUIRED" if verify else "CERT_NONE",
            retries=False,
        )

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Any:
        """One request; the decoded JSON answer, `ApiError` for a refusal, or an `OSError` when
        the API server cannot be reached or does not answer in time (`TimeoutError`,
        `ConnectionError`), as the socket's own errors are: callers that retry on the one catch
        the other too (urllib3's errors are not `OSError`s)."""
        url = self.server + path + (f"?{urlencode(query)}" if query else "")
        self._refresh_token()
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        try:
            resp = self._send(method, url, data, headers, timeout or self.timeout)
        except urllib3.exceptions.HTTPError as err:
            raise unreachable(method, path, err) from err
        text = resp.data.decode(errors="replace")
        if resp.status == 429:
            raise Throttled(method, path, text, resp.headers.get("Retry-After"))
        if not 200 <= resp.status < 300:
            raise ApiError(method, path, resp.status, text)
        return json.loads(text) if text else None

    def _send(
        self, method: str, url: str, data: bytes | None, headers: dict[str, str], timeout: float
    ) -> urllib3.BaseHTTPResponse:
        """The request, sent again once if it is a read (GET) and its connection dropped before
        any answer: the API server (or a balancer before it) may close a pooled keep-alive
        connection just as it is reused, and a read is safe to repeat. A write is not, nor is a
        request that timed out (the server may still be working on it)."""
        try:
            return self.pool.request(method, url, body=data, headers=headers, timeout=timeout)
        except urllib3.exceptions.ProtocolError:
            if method != "GET":
                raise
        return self.pool.request(method, url, body=data, headers=headers, timeout=timeout)

    def _refresh_token(self) -> None:
        """Read the token file again if it changed since the last request (when it cannot be
        read, the last token read stays)."""
        if self.token_file is None:
            return
        with self._token_lock:
            try:
                info = os.stat(self.token_file)
                seen = (info.st_mtime_ns, info.st_ino, info.st_size)
                if seen != self._token_read:
                    with open(self.token_file) as f:
                        token = f.read().strip()
                    self.headers["Authorization"] = f"Bearer {token}"
                    self._token_read = seen
            except OSError:
                pass


class Kube(JsonApi):
    """The operator's requests: the objects the controller reads and writes."""

    @classmethod
    def from_environment(cls) -> Kube:
        """The kubeconfig `KUBECONFIG` names, else the pod's service account."""
        configuration = k8s_client.Configuration()
        if os.environ.get("KUBECONFIG"):
            k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            token_file = None
        else:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            token_file = SERVICE_ACCOUNT_TOKEN
        api_key = configuration.api_key or {}
        return cls(
            configuration.host,
            token=api_key.get("authorization") or api_key.get("BearerToken"),
            token_file=token_file,
            ca_file=configuration.ssl_ca_cert,
            cert_file=configuration.cert_file,
            key_file=configuration.key_file,
            verify=configuration.verify_ssl,
        )

    # ---- the objects the controller uses ----

    def job_path(self, namespace: str, name: str = "") -> str:
        base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
        return f"{base}/{name}" if name else base

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.request("GET", self.job_path(namespace, name)))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def patch_job_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str | None = None,
    ) -> str:
        """Merge `status` into the job's; with `resource_version`, only over that version of the
        job (the API server answers 409, raised as `Stale`, when the job changed since). The
        job's version after it."""
        return self._patch_job(namespace, name, "/status", {"status": status}, resource_version)

    def remove_job_finalizer(self, job: dict[str, Any], finalizer: str) -> None:
        """Take `finalizer` off the job, over the version of it read (`Stale` when it changed)."""
        meta = job["metadata"]
        kept = [f for f in meta.get("finalizers") or [] if f != finalizer]
        body = {"metadata": {"finalizers": kept or None}}
        self._patch_job(meta["namespace"], meta["name"], "", body, meta.get("resourceVersion"))

    def _patch_job(
        self,
        namespace: str,
        name: str,
        subresource: str,
        body: dict[str, Any],
        resource_version: str | None,
    ) -> str:
        if resource_version is not None:
            body = {**body, "metadata": {**body.get("metadata", {}),
                                         "resourceVersion": resource_version}}  # fmt: skip
        path = self.job_path(namespace, name) + subresource
        try:
            answer = self.request("PATCH", path, body, content_type=MERGE)
        except ApiError as err:
            if err.status == 409 and resource_version is not None:
                raise Stale("PATCH", path, err.status, err.body) from None
            raise
        return str(((answer or {}).get("metadata") or {}).get("resourceVersion") or "")

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        answer = self.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector}
        )
        return list(answer["items"])

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to a core (`pods`, `secrets`), policy or PodGroup resource collection."""
        return dict(self.request("POST", _collection(namespace, resource), body))

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.request("GET", f"{_collection(namespace, resource)}/{name}"))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def patch(self, namespace: str, resource: str, name: str, body: dict[str, Any]) -> None:
        self.request(
            "PATCH", f"{_collection(namespace, resource)}/{name}", body, content_type=MERGE
        )

    def delete(self, namespace: str, resource: str, name: str) -> None:
        try:
            self.request("DELETE", f"{_collection(namespace, resource)}/{name}")
        except ApiError as err:
            if err.status != 404:
                raise

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/api/v1/nodes")["items"])


_APIS = {
    "poddisruptionbudgets": "/apis/policy/v1",
    "networkpolicies": "/apis/networking.k8s.io/v1",
    "certificates": "/apis/cert-manager.io/v1",
    "issuers": "/apis/cert-manager.io/v1",
    "podgroups": "/apis/scheduling.x-k8s.io/v1alpha1",
    "podgroups.scheduling.volcano.sh": "/apis/scheduling.volcano.sh/v1beta1",
}


def _collection(namespace: str, resource: str) -> str:
    """The collection of `resource`: a plural, or `plural.group` where two groups share it."""
    plural = resource.split(".", 1)[0]
    return f"{_APIS.get(resource, '/api/v1')}/namespaces/{namespace}/{plural}"
