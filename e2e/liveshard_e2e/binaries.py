"""Where the cluster's binaries live: the one place that turns ``e2e/versions.env`` into paths.

``e2e/build.sh`` builds into the same folder; this module only resolves and checks it, it never
builds.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent.parent
VERSIONS_FILE = E2E_DIR / "versions.env"
BUILD_SCRIPT = E2E_DIR / "build.sh"


class BinariesMissing(RuntimeError):
    """The binaries have not been built (run ``e2e/build.sh``)."""


def cache_root() -> Path:
    """The cache folder outside the repo: ``$LIVESHARD_CACHE`` or ``~/.cache/liveshard``."""
    env = os.environ.get("LIVESHARD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "liveshard"


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of ``versions.env``."""
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: line {raw!r} is not KEY=VALUE")
        versions[key.strip()] = value.strip()
    return versions


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every binary the cluster uses."""

    folder: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    helm: Path
    kueue: Path  # Kueue's manager, for the tests of its pod integration
    kube_scheduler_plugins: Path  # scheduler-plugins' scheduler, for the gang-scheduling tests

    @property
    def kueue_crds(self) -> Path:
        """The folder of Kueue's CRDs, copied from its module by the build."""
        return self.folder / "kueue-crds"

    @property
    def pod_group_crd(self) -> Path:
        """scheduler-plugins' PodGroup CRD, copied from its module by the build."""
        return self.folder / "podgroup-crd.yaml"

    @property
    def k8s_version(self) -> str:
        return read_versions()["K8S_VERSION"]


# The files whose digest is part of the cache key, in the order build.sh hashes them.
_KEYED_FILES = (
    "build.sh",
    "versions.env",
    "tools/etcd/go.mod",
    "tools/etcd/go.sum",
    "tools/k8s/go.mod",
    "tools/k8s/go.sum",
    "tools/kueue/go.mod",
    "tools/kueue/go.sum",
)


def build_digest() -> str:
    """The digest of the build inputs, as ``e2e/build.sh`` computes it."""
    digest = hashlib.sha256()
    for name in _KEYED_FILES:
        digest.update((E2E_DIR / name).read_bytes())
    return digest.hexdigest()[:10]


def binaries_folder() -> Path:
    """The folder ``e2e/build.sh`` builds into (it may not exist yet): keyed by the versions
    and the digest of the build inputs."""
    v = read_versions()
    key = f"k8s-v{v['K8S_VERSION']}_etcd-v{v['ETCD_VERSION']}_helm-v{v['HELM_VERSION']}"
    return cache_root() / "bin" / f"{key}_{build_digest()}"


def find_binaries() -> Binaries:
    """The built binaries, or :class:`BinariesMissing` saying how to build them."""
    folder = binaries_folder()
    names = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd"]
    names += ["helm", "kueue", "kube-scheduler-plugins"]
    paths = {name: folder / name for name in names}
    missing = [n for n, p in paths.items() if not os.access(p, os.X_OK)]
    if missing or not (folder / ".complete").exists():
        raise BinariesMissing(
            f"the local cluster's binaries are not built in {folder} "
            f"(missing: {', '.join(missing) or 'the .complete stamp'}); run {BUILD_SCRIPT}"
        )
    return Binaries(folder=folder, **{n.replace("-", "_"): p for n, p in paths.items()})
