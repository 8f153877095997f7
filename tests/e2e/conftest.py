"""Fixtures for end-to-end tests against a real local cluster (see docs/cluster.md).

One cluster per test session (``LIVESHARD_E2E_CLUSTER``, default ``pytest``, 3 nodes with 2 fake
GPUs each; under pytest-xdist one per worker, its name suffixed with the worker's), stopped at the
end; each test gets a fresh namespace. The tests that ask for it get a second cluster of two
nodes whose pods have network namespaces of their own (``netns_cluster``). Without built binaries
the tests skip, unless ``LIVESHARD_E2E_REQUIRED=1`` makes that a failure.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from liveshard_e2e import cluster
from liveshard_e2e.binaries import BinariesMissing, find_binaries
from liveshard_e2e.kubelet import netns
from liveshard_e2e.testing import Kube

NODES = 3
GPUS_PER_NODE = 2


def _session_cluster(suffix: str = "", **options: Any) -> Iterator[cluster.ClusterInfo]:
    try:
        find_binaries()
    except BinariesMissing as err:
        if os.environ.get("LIVESHARD_E2E_REQUIRED") == "1":
            pytest.fail(f"LIVESHARD_E2E_REQUIRED=1 but {err}", pytrace=False)
        pytest.skip(str(err))
    name = os.environ.get("LIVESHARD_E2E_CLUSTER", "pytest") + suffix
    # Under pytest-xdist (`scripts/test` runs the suite in two workers) each worker has its own.
    if worker := os.environ.get("PYTEST_XDIST_WORKER"):
        name = f"{name}-{worker}"
    info = cluster.up(cluster.ClusterOptions(name=name, **options))
    yield info
    if os.environ.get("LIVESHARD_E2E_KEEP") != "1":
        cluster.down(name)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[cluster.ClusterInfo]:
    """A running cluster for the whole session."""
    yield from _session_cluster(nodes=NODES, gpus_per_node=GPUS_PER_NODE)


@pytest.fixture(scope="session")
def netns_cluster() -> Iterator[cluster.ClusterInfo]:
    """A cluster whose pods have network namespaces of their own and whose NetworkPolicies are
    enforced (started for the tests that ask for it; they skip, saying why, where the machine
    cannot give pods namespaces: no root, a tool or a kernel feature missing)."""
    if why := netns.unavailable():
        pytest.skip(f"no pod network of namespaces here: {why}")
    yield from _session_cluster("-netns", nodes=2, pod_network="netns")


def _namespace(info: cluster.ClusterInfo, request: pytest.FixtureRequest) -> Iterator[Kube]:
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    namespace = f"{stem}-{uuid.uuid4().hex[:5]}"
    admin = Kube(info)
    yield admin.create_namespace(namespace)
    # Workers answer SIGTERM by waiting to be released, for their grace period (minutes): with
    # their operator gone, they would train on and slow the next tests. Force them out now.
    admin.run("kubectl", "delete", "pods", "--all", "-n", namespace, "--grace-period=0",
              "--force", "--wait=false", check=False)  # fmt: skip
    admin.run("kubectl", "delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture
def kube(local_cluster: cluster.ClusterInfo, request: pytest.FixtureRequest) -> Iterator[Kube]:
    """The cluster, with a fresh namespace named after the test (deleted afterwards)."""
    yield from _namespace(local_cluster, request)


@pytest.fixture
def netns_kube(
    netns_cluster: cluster.ClusterInfo, request: pytest.FixtureRequest
) -> Iterator[Kube]:
    """The cluster of network namespaces, with a fresh namespace named after the test."""
    yield from _namespace(netns_cluster, request)
