"""What the CRD and chart tests share: the repository's deployment files, installing the CRD on a
test cluster, and the example job as a mutable dict. No test lives here."""

from __future__ import annotations

import copy
import functools
import uuid
from pathlib import Path
from typing import Any

import yaml

from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "elastictrainingjobs.liveshard.io.yaml"
CRD_NAME = "elastictrainingjobs.liveshard.io"
CHART = ROOT / "charts" / "liveshard"
EXAMPLES = ROOT / "examples"
API = "/apis/liveshard.io/v1alpha1"


def install_crd(kube: Kube, path: Path = CRD_FILE, names: tuple[str, ...] = (CRD_NAME,)) -> None:
    """Applies the CRDs of `path` (a file or a folder; server-side, idempotent: other tests of the
    session may have installed the same) and waits until the API server serves those `names`.
    Never deleted: they are cluster-scoped and shared by every test of the session."""
    kube.run(
        "kubectl",
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=liveshard-tests",
        "-f",
        str(path),
    )

    def established(name: str) -> bool:
        crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conditions = ((crd or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    # Polled: `kubectl wait` fails outright when it reads the CRD before it has any condition.
    for name in names:
        wait_until(functools.partial(established, name), 60, f"crd/{name} established")


def crd_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the CRD's one version, as written in crds/."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def example(name: str) -> dict[str, Any]:
    """A fresh copy of ``examples/<name>.yaml``."""
    return copy.deepcopy(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def release_name() -> str:
    """A helm release name unique in the cluster (its ClusterRole is cluster-scoped)."""
    return f"ls-{uuid.uuid4().hex[:6]}"
