"""The operator's Kubernetes API access: JSON requests with the operator's own identity.

Objects are handled as the API's plain JSON (the typed models rename fields). Credentials come from
`kubernetes.config`: the kubeconfig that `KUBECONFIG` names, or the pod's service account in a
cluster. kopf keeps its own connection for watching; this one is for the controller's reads and
writes from its thread.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlencode

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from .render import GROUP, PLURAL, VERSION

MERGE = "application/merge-patch+json"


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")


class Kube:
    """JSON requests against the API server; safe to share between threads."""

    def __init__(self, configuration: k8s_client.Configuration) -> None:
        self.server = configuration.host.rstrip("/")
        self.headers = {"Accept": "application/json"}
        token = (configuration.api_key or {}).get("authorization") or (
            configuration.api_key or {}
        ).get("BearerToken")
        if token:
            self.headers["Authorization"] = (
                token if token.startswith("Bearer") else f"Bearer {token}"
            )
        self.pool = urllib3.PoolManager(
            maxsize=8,
            ca_certs=configuration.ssl_ca_cert,
            cert_file=configuration.cert_file,
            key_file=configuration.key_file,
            cert_reqs="CERT_REQUIRED" if configuration.verify_ssl else "CERT_NONE",
            retries=False,
        )

    @classmethod
    def from_environment(cls) -> Kube:
        """The kubeconfig `KUBECONFIG` names, else the pod's service account."""
        configuration = k8s_client.Configuration()
        if os.environ.get("KUBECONFIG"):
            k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return cls(configuration)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 15.0,
    ) -> Any:
        url = self.server + path + (f"?{urlencode(query)}" if query else "")
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        resp = self.pool.request(method, url, body=data, headers=headers, timeout=timeout)
        text = resp.data.decode(errors="replace")
        if not 200 <= resp.status < 300:
            raise ApiError(method, path, resp.status, text)
        return json.loads(text) if text else None

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

    def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        path = self.job_path(namespace, name) + "/status"
        self.request("PATCH", path, {"status": status}, content_type=MERGE)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        answer = self.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector}
        )
        return list(answer["items"])

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to a core (`pods`, `secrets`) or policy resource collection."""
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


def _collection(namespace: str, resource: str) -> str:
    if resource == "poddisruptionbudgets":
        return f"/apis/policy/v1/namespaces/{namespace}/{resource}"
    return f"/api/v1/namespaces/{namespace}/{resource}"
