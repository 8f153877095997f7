"""A pod's API credentials, as the kubelet projects them: a TokenRequest bound to the pod for its
service account, written as ``serviceaccount/{token,ca.crt,namespace}`` in the pod's folder and
as a kubeconfig (processes share one host, so the fixed in-cluster path cannot be used)."""

from __future__ import annotations

from pathlib import Path

from liveshard_e2e.controlplane import write_kubeconfig
from liveshard_e2e.kubelet.config import KubeletConfig
from liveshard_e2e.rest import Rest

TOKEN_SECONDS = 86400


def write_pod_credentials(
    rest: Rest,
    config: KubeletConfig,
    namespace: str,
    pod: str,
    uid: str,
    account: str,
    folder: Path,
    host: str = "127.0.0.1",
) -> Path:
    """Mints the pod's token (an :class:`~liveshard_e2e.rest.ApiError` while the account does
    not exist yet) and returns the path of the pod's kubeconfig, whose server is at `host`."""
    answer = rest.post(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": TOKEN_SECONDS,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid},
            },
        },
    )
    token = answer["status"]["token"]
    sa_dir = folder / "serviceaccount"
    sa_dir.mkdir(exist_ok=True)
    (sa_dir / "token").write_text(token)
    (sa_dir / "namespace").write_text(namespace)
    (sa_dir / "ca.crt").write_bytes(Path(config.ca_file).read_bytes())
    kubeconfig = folder / "kubeconfig"
    server = f"https://{host}:{config.apiserver_port}"
    write_kubeconfig(kubeconfig, server, Path(config.ca_file), {"token": token})
    return kubeconfig
