"""The Helm chart (charts/liveshard): its CRD is crds/ byte for byte, `helm lint` is clean, what it
renders is accepted by the API server, the operator's RBAC is exactly what the operator uses (a
pod running as its ServiceAccount gets 403 for the rest), the metrics' Service, monitors,
NetworkPolicy rules and Grafana dashboard are what docs/metrics.md says, and `helm install --wait`
brings up a ready, non-root operator pod.

The rendering tests need only the helm binary. The others need the local cluster; they install
the chart with a stand-in operator (a health endpoint at the address the chart passes in
``--liveness``) so that they test the chart, not the operator, and start one probe pod each. The
last test runs the real operator under the chart when ``liveshard-operator`` is installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from liveshard_e2e.binaries import BinariesMissing, find_binaries
from liveshard_e2e.testing import Kube, python_pod, ready
from liveshard_e2e.waiting import wait_until
from tests.e2e.deployment import API, CHART, CRD_FILE, ROOT, example, install_crd, release_name


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return find_binaries().helm
    except BinariesMissing as err:
        if os.environ.get("LIVESHARD_E2E_REQUIRED") == "1":
            pytest.fail(f"LIVESHARD_E2E_REQUIRED=1 but {err}", pytrace=False)
        pytest.skip(str(err))


def _render(helm: Path, *values: str, namespace: str = "ops") -> list[dict[str, Any]]:
    """`helm template` of the chart (release "rel") as a list of objects."""
    result = subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--namespace", namespace, *values],
        capture_output=True,
        text=True,
        check=True,
    )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _one(objects: list[dict[str, Any]], kind: str, namespace: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in objects
        if o["kind"] == kind and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]
    assert len(found) == 1, f"{len(found)} {kind} objects in {namespace or 'the chart'}"
    return found[0]


def test_chart_crd_is_a_byte_copy_of_crds() -> None:
    copies = sorted(p.name for p in (CHART / "crds").iterdir())
    assert copies == sorted(p.name for p in CRD_FILE.parent.glob("*.yaml"))
    for name in copies:
        assert (CHART / "crds" / name).read_bytes() == (CRD_FILE.parent / name).read_bytes(), (
            f"charts/liveshard/crds/{name} differs from crds/{name}: run scripts/sync-crd"
        )
    check = subprocess.run([str(ROOT / "scripts" / "sync-crd"), "--check"], capture_output=True)
    assert check.returncode == 0, check.stderr


METRICS_ON = [
    "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.dashboard.enabled=true",
]  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--set", "watchNamespaces={a,b}", "--set", "networkPolicy.enabled=true"],
        [*METRICS_ON, "--set", "networkPolicy.enabled=true"],
    ],
    ids=["defaults", "namespaced-with-network-policy", "monitors-and-dashboard"],
)
def test_helm_lint_is_clean(helm: Path, values: list[str]) -> None:
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *values], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout
    assert "0 chart(s) failed" in result.stdout


def test_values_schema_refuses_a_misspelt_key(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--set", "watchNamespace=a"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "additional properties 'watchNamespace' not allowed" in result.stderr


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ("metrics.serviceMonitor.enable=true", "additional properties 'enable' not allowed"),
        ("metrics.podMonitor.interval=often", "does not match pattern"),
        ("metrics.port=0", "minimum"),
    ],
)
def test_values_schema_refuses_bad_metrics_values(helm: Path, value: str, refusal: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--set", value], capture_output=True, text=True
    )
    assert result.returncode != 0 and refusal in result.stderr, result.stderr


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) for every combination a list of PolicyRules grants."""
    assert all(set(r) == {"apiGroups", "resources", "verbs"} for r in rules), rules
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _expand(table: dict[tuple[str, str], str]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for (g, r), verbs in table.items() for v in verbs.split()}


# What the operator and kopf use inside the namespaces they serve, and nothing more.
NAMESPACED = _expand(
    {
        ("liveshard.io", "elastictrainingjobs"): "get list watch patch",
        ("liveshard.io", "elastictrainingjobs/status"): "patch",
        ("liveshard.io", "elastictrainingjobs/finalizers"): "update",
        ("", "pods"): "get list watch create patch delete",
        ("", "secrets"): "get create patch",
        ("policy", "poddisruptionbudgets"): "get create",
        ("networking.k8s.io", "networkpolicies"): "get create patch",
        ("scheduling.x-k8s.io", "podgroups"): "get create",
        ("scheduling.volcano.sh", "podgroups"): "get create",
        ("", "events"): "create",
    }
)
CLUSTER = _expand(
    {
        ("apiextensions.k8s.io", "customresourcedefinitions"): "list watch",
        ("", "nodes"): "get list watch",
    }
)


def test_rbac_grants_exactly_what_the_operator_uses(helm: Path) -> None:
    # By default the release's namespace alone: no ClusterRole grants anything on Secrets.
    default = _render(helm)
    assert _grants(_one(default, "ClusterRole")["rules"]) == CLUSTER | _expand(
        {("", "namespaces"): "list watch"}
    )
    (role,) = [
        o for o in default
        if o["kind"] == "Role" and o["metadata"]["name"] == "rel-liveshard-operator"
    ]  # fmt: skip
    assert role["metadata"]["namespace"] == "ops" and _grants(role["rules"]) == NAMESPACED
    (container,) = _one(default, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "--namespace=ops"
    refused = subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--set", "watchAllNamespaces=true",
         "--set", "watchNamespaces={a}"], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "set one or the other" in refused.stderr

    everywhere = _render(helm, "--set", "watchAllNamespaces=true")
    assert _grants(_one(everywhere, "ClusterRole")["rules"]) == NAMESPACED | CLUSTER
    binding = _one(everywhere, "ClusterRoleBinding")
    account = _one(everywhere, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "ops"}]
    # Leader election: its one Lease, in the release's namespace only, by name but for create.
    election = _one(everywhere, "Role")
    assert election["metadata"]["namespace"] == "ops"
    assert election["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["rel-liveshard-operator"], "verbs": ["get", "update"]},
    ]  # fmt: skip
    election_binding = _one(everywhere, "RoleBinding", "ops")
    assert election_binding["roleRef"]["name"] == election["metadata"]["name"]
    assert election_binding["subjects"] == binding["subjects"]
    alone = _render(
        helm, "--set", "operator.leaderElection.enabled=false", "--set", "watchAllNamespaces=true"
    )
    assert not [o for o in alone if o["kind"] in ("Role", "RoleBinding")]

    # Listed namespaces: what lives in them only there; namespaces list/watch for kopf.
    listed = _render(helm, "--set", "watchNamespaces={team-a,team-b}")
    cluster_role = _one(listed, "ClusterRole")
    assert _grants(cluster_role["rules"]) == CLUSTER | _expand({("", "namespaces"): "list watch"})
    for namespace in ("team-a", "team-b"):
        assert _grants(_one(listed, "Role", namespace)["rules"]) == NAMESPACED
        assert "leases" not in json.dumps(_one(listed, "Role", namespace)["rules"])
        role_binding = _one(listed, "RoleBinding", namespace)
        assert role_binding["roleRef"]["kind"] == "Role"
        assert role_binding["subjects"] == binding["subjects"]

    # With cert-manager: the job's Issuers and Certificates too, and the flag that makes them.
    issuing = _expand({("cert-manager.io", "issuers"): "get create",
                       ("cert-manager.io", "certificates"): "get create"})  # fmt: skip
    managed = _render(helm, "--set", "certManager.enabled=true", "--set", "watchNamespaces={a}")
    assert _grants(_one(managed, "Role", "a")["rules"]) == NAMESPACED | issuing
    (container,) = _one(managed, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--cert-manager" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--cert-manager-issuer")]
    (container,) = _one(everywhere, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--cert-manager" not in container["args"]
    # A user's issuer named, by kind and (when not cert-manager's) group.
    roles = "rel-liveshard-operator"
    for ref, arg in [(["kind=ClusterIssuer"], "ClusterIssuer/corp"),
                     (["kind=PCAIssuer", "group=awspca.cert-manager.io"],
                      "PCAIssuer.awspca.cert-manager.io/corp")]:  # fmt: skip
        sets = [f"certManager.issuerRef.{v}" for v in ["name=corp", *ref]]
        flags = [x for v in ["certManager.enabled=true", *sets] for x in ("--set", v)]
        named = _render(helm, *flags)
        (container,) = _one(named, "Deployment")["spec"]["template"]["spec"]["containers"]
        assert f"--cert-manager-issuer={arg}" in container["args"]
        # The operator then makes no Issuer.
        only = _expand({("cert-manager.io", "certificates"): "get create"})
        (role,) = [o for o in named if o["kind"] == "Role" and o["metadata"]["name"] == roles]
        assert _grants(role["rules"]) == NAMESPACED | only
    argv = [str(helm), "template", "rel", str(CHART), "--set", "certManager.issuerRef.name=c"]
    refused = subprocess.run(argv, capture_output=True, text=True)
    assert refused.returncode != 0
    assert "certManager.issuerRef is used only with certManager.enabled=true" in refused.stderr
    # Without a NetworkPolicy per job, no grant for one.
    alone = _render(helm, "--set", "networkPolicy.perJob=false", "--set", "watchAllNamespaces=true")
    policies = _expand({("networking.k8s.io", "networkpolicies"): "get create patch"})
    assert _grants(_one(alone, "ClusterRole")["rules"]) == NAMESPACED - policies | CLUSTER


def test_deployment_runs_a_leader_and_a_standby_non_root_with_probes(helm: Path) -> None:
    deployment = _one(_render(helm), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }  # fmt: skip
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["command"] == ["liveshard-operator"]
    assert container["args"] == [
        "--namespace=ops",
        "--liveness=http://$(POD_IP):8080/healthz",
        "--metrics-address=$(POD_IP)",
        "--metrics-port=9401",
        # Each job's NetworkPolicy lets these pods (the operator's) call the agents.
        "--operator-pod-labels="
        + ",".join(f"{k}={v}" for k, v in sorted(spec["selector"]["matchLabels"].items())),
        "--operator-namespace=ops",
        "--job-metrics-from=[]",
        "--leader-elect",
        "--leader-elect-lease-name=rel-liveshard-operator",
        "--leader-elect-namespace=ops",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
    ]
    for name, path in (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name")):
        assert {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} in container["env"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [
        {"name": "health", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9401, "protocol": "TCP"},
    ]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]

    listed = _one(_render(helm, "--set", "watchNamespaces={team-a,team-b}"), "Deployment")
    args = listed["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--namespace=team-a", "--namespace=team-b"]

    # Without leader election: one operator, whatever `operator.replicas` says.
    alone = _render(helm, "--set", "operator.leaderElection.enabled=false")
    spec = _one(alone, "Deployment")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert not [a for a in spec["template"]["spec"]["containers"][0]["args"] if "leader" in a]


def test_network_policy_opens_agent_ports_to_the_operator_and_workers_only(helm: Path) -> None:
    assert not [o for o in _render(helm) if o["kind"] == "NetworkPolicy"]
    objects = _render(helm, "--set", "networkPolicy.enabled=true", "--set", "watchNamespaces={a,b}")
    operator_labels = _one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    workers = {"matchExpressions": [{"key": "liveshard.io/job", "operator": "Exists"}]}
    for namespace in ("a", "b"):
        policy = _one(objects, "NetworkPolicy", namespace)["spec"]
        assert policy["podSelector"] == workers
        assert policy["policyTypes"] == ["Ingress"]
        from_operator, from_workers, scrapers = policy["ingress"]
        assert from_operator == {
            "from": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                    "podSelector": {"matchLabels": operator_labels},
                }
            ],
            "ports": [{"protocol": "TCP", "port": 7070}],
        }
        # Workers talk to each other on any port: agents, the c10d store, the collectives.
        assert from_workers == {"from": [{"podSelector": workers}]}
        # Anyone may scrape the metrics port (networkPolicy.metricsFrom is empty): that alone.
        assert scrapers == {"ports": [{"protocol": "TCP", "port": "metrics"}]}
    # The operator's pod: its health and metrics ports, from anywhere, and nothing else.
    operator = _one(objects, "NetworkPolicy", "ops")["spec"]
    assert operator["podSelector"] == {"matchLabels": operator_labels}
    assert operator["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": "health"}]},
        {"ports": [{"protocol": "TCP", "port": "metrics"}]},
    ]


def test_network_policy_opens_metrics_ports_to_metrics_from_only(helm: Path) -> None:
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    objects = _render(
        helm, "--set", "networkPolicy.enabled=true",
        "--set-json", f"networkPolicy.metricsFrom=[{json.dumps(monitoring)}]",
    )  # fmt: skip
    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 2  # the operator's and the workers', both in the release's namespace
    for policy in policies:
        (rule,) = [r for r in policy["ingress"] if {"protocol": "TCP", "port": "metrics"} in (
            r.get("ports") or []
        )]  # fmt: skip
        assert rule == {"ports": [{"protocol": "TCP", "port": "metrics"}], "from": [monitoring]}


def test_operator_metrics_are_served_on_the_pod_ip_behind_a_service(helm: Path) -> None:
    objects = _render(helm, "--set", "metrics.port=9500")
    deployment = _one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=9500" in container["args"]
    assert "--metrics-address=$(POD_IP)" in container["args"]
    assert {"name": "metrics", "containerPort": 9500, "protocol": "TCP"} in container["ports"]
    service = _one(objects, "Service")
    assert service["metadata"]["namespace"] == "ops"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9500, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_monitors_render_only_when_enabled_and_keep_the_series_job_label(helm: Path) -> None:
    monitors = ("ServiceMonitor", "PodMonitor", "ConfigMap")
    assert not [o for o in _render(helm) if o["kind"] in monitors]
    objects = _render(
        helm, "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.serviceMonitor.labels.release=prom",
    )  # fmt: skip
    service = _one(objects, "Service")
    monitor = _one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "honorLabels": True}
    ]
    workers = _one(objects, "PodMonitor")
    assert workers["metadata"]["labels"]["release"] == "prom"
    assert workers["spec"]["selector"] == {
        "matchExpressions": [{"key": "liveshard.io/job", "operator": "Exists"}]
    }
    assert workers["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}  # the release's
    everywhere = _render(helm, "--set", "metrics.serviceMonitor.enabled=true",
                         "--set", "watchAllNamespaces=true")  # fmt: skip
    assert _one(everywhere, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}
    assert workers["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": True}
    ]
    listed = _render(
        helm, "--set", "metrics.serviceMonitor.enabled=true", "--set", "watchNamespaces={a,b}"
    )
    selector = _one(listed, "PodMonitor")["spec"]["namespaceSelector"]
    assert selector == {"matchNames": ["a", "b"]}


DASHBOARD = CHART / "dashboards" / "liveshard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"


def _documented_series() -> set[str]:
    """The series docs/metrics.md lists in its tables (the first column's names)."""
    return set(re.findall(r"^\| `(liveshard_\w+)` \|", METRICS_DOC.read_text(), re.MULTILINE))


def _series_in(expression: str) -> set[str]:
    """The series an expression names, a histogram's _bucket, _sum and _count by its own name."""
    return {
        re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"liveshard_\w+", expression)
    }


def test_dashboard_renders_with_the_sidecar_label_and_queries_documented_series(
    helm: Path,
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert not [o for o in _render(helm) if o["kind"] == "ConfigMap"]
    objects = _render(helm, "--set", "metrics.dashboard.enabled=true")
    config_map = _one(objects, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "ops"
    assert json.loads(config_map["data"]["liveshard.json"]) == dashboard
    elsewhere = _render(helm, "--set", "metrics.dashboard.enabled=true",
                        "--set", "metrics.dashboard.namespace=grafana")  # fmt: skip
    assert _one(elsewhere, "ConfigMap")["metadata"]["namespace"] == "grafana"

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["job"]["multi"] and "liveshard_" in variables["job"]["definition"]
    titles = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}
    wanted = {
        "Loss": "liveshard_loss",
        "Tokens per second": "liveshard_tokens_per_second",
        "Step": "liveshard_step",
        "Members by phase": "liveshard_operator_members",
    }
    for title, series in wanted.items():
        assert any(series in e and "$job" in e for e in titles[title]), (title, titles[title])
    (reconfigurations,) = [a for a in dashboard["annotations"]["list"] if a.get("expr")]
    assert "liveshard_reconfigurations_total" in reconfigurations["expr"]
    expressions = [e for exprs in titles.values() for e in exprs]
    expressions += [reconfigurations["expr"], variables["job"]["definition"]]
    documented = _documented_series()
    for expression in expressions:
        assert _series_in(expression) <= documented, expression


def test_rendered_chart_passes_server_side_dry_run(kube: Kube, helm: Path) -> None:
    other = kube.create_namespace(f"{kube.namespace}-b")
    try:
        variants = [
            ["--include-crds"],
            [
                "--set-json",
                f'watchNamespaces=["{kube.namespace}","{other.namespace}"]',
                "--set",
                "networkPolicy.enabled=true",
                "--set",
                "metrics.dashboard.enabled=true",
            ],
        ]
        for values in variants:
            rendered = subprocess.run(
                [str(helm), "template", release_name(), str(CHART), "-n", kube.namespace, *values],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            # Objects name their namespaces; kubectl gets none of its own.
            applied = kube.run("kubectl", "apply", "--dry-run=server", "-f", "-", input=rendered)
            kinds = {line.split("/")[0].split(".")[0] for line in applied.stdout.splitlines()}
            assert "deployment" in kinds and "serviceaccount" in kinds, applied.stdout
    finally:
        kube.run("kubectl", "delete", "namespace", other.namespace, "--wait=false", check=False)


# A stand-in for the operator: it logs its arguments and answers /healthz where --liveness says.
STAND_IN = """
import http.server, json, sys, urllib.parse
print("ARGS " + json.dumps(sys.argv[1:]), flush=True)
liveness = next(a for a in sys.argv if a.startswith("--liveness="))
url = urllib.parse.urlparse(liveness.split("=", 1)[1])
if not url.hostname:  # $(POD_IP) was empty: binding every address would be wrong
    sys.exit("no host in " + liveness)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == url.path else 404)
        self.end_headers()
http.server.HTTPServer((url.hostname, url.port), Health).serve_forever()
"""


def _install(
    kube: Kube, tmp_path: Path, values: dict[str, Any], real_operator: bool = False
) -> str:
    """`helm install --wait` of the chart into the test's namespace; returns the release name."""
    release = release_name()
    # One operator pod (a leader, no standby), so that the tests can look at its log.
    values = {"operator": {"replicas": 1}, **values}
    if not real_operator:
        values["operator"] = {**values["operator"], "command": ["python", "-u", "-c", STAND_IN]}
    values_file = tmp_path / f"{release}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    kube.run(
        "helm", "install", release, str(CHART), "-n", kube.namespace, "-f", str(values_file),
        "--wait", "--timeout=90s", timeout=120,
    )  # fmt: skip
    return release


@pytest.fixture
def installed(kube: Kube, tmp_path: Path) -> Iterator[tuple[Kube, Path]]:
    """The test's namespace with the CRD; every release installed there is uninstalled after."""
    install_crd(kube)
    yield kube, tmp_path
    for release in kube.run("helm", "list", "-q", "-n", kube.namespace).stdout.split():
        kube.run("helm", "uninstall", release, "-n", kube.namespace, "--wait", check=False)


def test_install_waits_for_a_ready_operator_that_passes_restricted_pod_security(
    installed: tuple[Kube, Path],
) -> None:
    kube, tmp_path = installed
    # Pods that are not restricted-compliant (root, privilege escalation, ...) are refused here.
    kube.kubectl(
        "label", "namespace", kube.namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    bare = python_pod("bare", "pass")
    refused = kube.kubectl("apply", "-f", "-", input=json.dumps(bare), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr
    release = _install(kube, tmp_path, {})
    (pod,) = kube.pods(f"app.kubernetes.io/instance={release}")
    assert ready(pod)
    # It serves its health endpoint on the pod's IP, as the chart told it to.
    ip = pod["status"]["podIP"]
    args = json.loads(kube.logs(pod["metadata"]["name"]).split("ARGS ", 1)[1].splitlines()[0])
    # The labels the jobs' NetworkPolicies name the operator's pods by: this pod's.
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if k in (
        "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"
    )}  # fmt: skip
    assert len(labels) == 3
    assert args == [
        f"--namespace={kube.namespace}",
        f"--liveness=http://{ip}:8080/healthz",
        f"--metrics-address={ip}",
        "--metrics-port=9401",
        f"--operator-pod-labels={','.join(f'{k}={v}' for k, v in sorted(labels.items()))}",
        f"--operator-namespace={kube.namespace}",
        "--job-metrics-from=[]",
        "--leader-elect",
        f"--leader-elect-lease-name={_account(release)}",
        f"--leader-elect-namespace={kube.namespace}",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
    ]

    kube.run("helm", "uninstall", release, "-n", kube.namespace, "--wait", "--timeout=60s")
    assert (
        kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release}-liveshard-operator")
        is None
    )
    # The CRD stays (helm never deletes CRDs): jobs outlive an uninstall.
    assert kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_FILE.stem}")


# Runs as the operator's ServiceAccount: each request's HTTP status, one JSON line each.
# A request the API server throttles (429: its priority and fairness queues full on a loaded
# machine) is made again after the Retry-After it names, as Kubernetes clients do.
PROBE = """
import json, os, ssl, time, urllib.error, urllib.request, yaml
cfg = yaml.safe_load(open(os.environ["KUBECONFIG"]))
server = cfg["clusters"][0]["cluster"]["server"]
ctx = ssl.create_default_context(cafile=cfg["clusters"][0]["cluster"]["certificate-authority"])
token = cfg["users"][0]["user"]["token"]
for name, method, path, body in json.loads(os.environ["REQUESTS"]):
    kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
    req = urllib.request.Request(server + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + token, "Content-Type": kind})
    for _ in range(10):
        try:
            status = urllib.request.urlopen(req, context=ctx).status
        except urllib.error.HTTPError as err:
            status = err.code
            if status == 429:
                time.sleep(float(err.headers.get("Retry-After") or 1))
                continue
        break
    print("RESULT " + json.dumps([name, status]), flush=True)
"""


def _statuses(
    kube: Kube, account: str, requests: list[tuple[str, str, str, Any]]
) -> dict[str, int]:
    """Runs one pod as ``account`` that makes ``requests``; each one's HTTP status by name."""
    env = [{"name": "REQUESTS", "value": json.dumps(requests)}]
    pod = python_pod(
        "probe", PROBE, serviceAccountName=account, restartPolicy="Never", container={"env": env}
    )
    kube.apply(pod)
    kube.wait_pod("probe", lambda p: p["status"].get("phase") == "Succeeded", "Succeeded")
    lines = [line for line in kube.logs("probe").splitlines() if line.startswith("RESULT ")]
    kube.kubectl("delete", "pod", "probe", "--wait=false")
    return dict(json.loads(line.removeprefix("RESULT ")) for line in lines)


def _account(release: str) -> str:
    return f"{release}-liveshard-operator"


def test_operator_account_gets_403_for_what_it_does_not_use(installed: tuple[Kube, Path]) -> None:
    kube, tmp_path = installed
    release = _install(kube, tmp_path, {})
    ns = f"/api/v1/namespaces/{kube.namespace}"
    jobs = f"{API}/namespaces/{kube.namespace}/elastictrainingjobs"
    pdbs = f"/apis/policy/v1/namespaces/{kube.namespace}/poddisruptionbudgets"
    roles = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{kube.namespace}/roles"
    deployment = f"/apis/apps/v1/namespaces/{kube.namespace}/deployments/{_account(release)}"
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{kube.namespace}/leases"
    lease = {"metadata": {"name": _account(release)}, "spec": {}}
    event = {
        "metadata": {"generateName": "probe-"},
        "involvedObject": {"kind": "Pod", "namespace": kube.namespace, "name": "probe"},
        "reason": "Probe",
        "message": "RBAC probe",
        "type": "Normal",
    }
    secret = {"metadata": {"name": "job-token"}, "stringData": {"token": "t"}}
    pdb = {"metadata": {"name": "job"}, "spec": {"maxUnavailable": 1, "selector": {}}}
    allowed = [
        ("list jobs", "GET", jobs, None),
        ("list pods", "GET", f"{ns}/pods", None),
        ("create pdb", "POST", pdbs, pdb),
        ("get pdb", "GET", f"{pdbs}/job", None),
        ("create secret", "POST", f"{ns}/secrets", secret),
        ("get secret", "GET", f"{ns}/secrets/job-token", None),
        ("create event", "POST", f"{ns}/events", event),
        ("list nodes", "GET", "/api/v1/nodes", None),
        ("list crds", "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", None),
        ("list namespaces", "GET", "/api/v1/namespaces", None),  # kopf resolves the watched one
        ("create its lease", "POST", leases, lease),
        ("get its lease", "GET", f"{leases}/{_account(release)}", None),
    ]  # fmt: skip
    forbidden = [
        ("list secrets", "GET", f"{ns}/secrets", None),
        ("delete a secret", "DELETE", f"{ns}/secrets/job-token", None),
        ("delete a pdb", "DELETE", f"{pdbs}/job", None),
        ("read configmaps", "GET", f"{ns}/configmaps", None),
        ("delete its deployment", "DELETE", deployment, None),
        ("delete a job", "DELETE", f"{jobs}/any", None),
        ("scale a job", "PATCH", f"{jobs}/any/scale", {"spec": {"replicas": 1}}),
        ("evict a pod", "POST", f"{ns}/pods/any/eviction", {}),
        ("cordon a node", "PATCH", "/api/v1/nodes/node-0", {"spec": {"unschedulable": True}}),
        # The default install watches its own namespace: no Secret access anywhere else.
        ("get a secret elsewhere", "GET", "/api/v1/namespaces/default/secrets/job-token", None),
        ("create a secret elsewhere", "POST", "/api/v1/namespaces/default/secrets", secret),
        ("list pods elsewhere", "GET", "/api/v1/namespaces/default/pods", None),
        ("create a role", "POST", roles, {}),
        ("list leases", "GET", leases, None),
        ("get another lease", "GET", f"{leases}/other", None),
        ("delete its lease", "DELETE", f"{leases}/{_account(release)}", None),
        ("leases elsewhere", "GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/x",
         None),
    ]  # fmt: skip
    statuses = _statuses(kube, _account(release), allowed + forbidden)
    assert {name: statuses.get(name) for name, *_ in forbidden} == {
        name: 403 for name, *_ in forbidden
    }
    assert all(200 <= statuses.get(name, 0) < 300 for name, *_ in allowed), statuses


def test_watch_namespaces_confine_the_operator_account(installed: tuple[Kube, Path]) -> None:
    kube, tmp_path = installed
    watched = kube.create_namespace(f"{kube.namespace}-w")
    try:
        release = _install(kube, tmp_path, {"watchNamespaces": [watched.namespace]})
        (pod,) = kube.pods(f"app.kubernetes.io/instance={release}")
        assert f'"--namespace={watched.namespace}"' in kube.logs(pod["metadata"]["name"])
        there, here = watched.namespace, kube.namespace
        requests = [
            ("pods where watched", "GET", f"/api/v1/namespaces/{there}/pods", None),
            ("jobs where watched", "GET", f"{API}/namespaces/{there}/elastictrainingjobs", None),
            ("pods elsewhere", "GET", f"/api/v1/namespaces/{here}/pods", None),
            ("jobs elsewhere", "GET", f"{API}/namespaces/{here}/elastictrainingjobs", None),
            ("pods everywhere", "GET", "/api/v1/pods", None),
            ("namespaces", "GET", "/api/v1/namespaces", None),
            ("nodes", "GET", "/api/v1/nodes", None),
        ]  # fmt: skip
        assert _statuses(kube, _account(release), requests) == {
            "pods where watched": 200,
            "jobs where watched": 200,
            "pods elsewhere": 403,
            "jobs elsewhere": 403,
            "pods everywhere": 403,
            "namespaces": 200,
            "nodes": 200,
        }
    finally:
        kube.run("kubectl", "delete", "namespace", watched.namespace, "--wait=false", check=False)


# Pods run with the interpreter's folder first on PATH (docs/cluster.md).
OPERATOR_SCRIPT = Path(sys.executable).parent / "liveshard-operator"


@pytest.mark.skipif(not OPERATOR_SCRIPT.exists(), reason=f"{OPERATOR_SCRIPT} is not installed")
def test_real_operator_starts_its_first_job_under_the_chart_rbac(
    installed: tuple[Kube, Path],
) -> None:
    kube, tmp_path = installed
    release = _install(kube, tmp_path, {"watchNamespaces": [kube.namespace]}, real_operator=True)
    job = example("tiny-job")
    job["spec"]["replicas"] = 1
    # Short deadlines and grace period: the worker is gone soon after the job is deleted.
    job["spec"]["reconfiguration"] = {
        "opTimeoutSeconds": 2,
        "switchDeadlineSeconds": 5,
        "prepareDeadlineSeconds": 10,
    }
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 15
    kube.apply(job)
    # The operator's first steps each need a grant: the token Secret, the PDB, a worker pod.
    ns = f"/api/v1/namespaces/{kube.namespace}"
    wait_until(lambda: kube.get(f"{ns}/secrets/tiny-token"), 60, "the job's token Secret")
    pdbs = f"/apis/policy/v1/namespaces/{kube.namespace}/poddisruptionbudgets"
    wait_until(lambda: kube.get(f"{pdbs}/tiny"), 60, "the job's PodDisruptionBudget")
    wait_until(lambda: kube.pods("liveshard.io/job=tiny"), 60, "a worker pod of the job")
    (operator,) = kube.pods(f"app.kubernetes.io/instance={release}")
    log = kube.logs(operator["metadata"]["name"])
    # How kopf (aiohttp: "403, message=") and the kubernetes client ("(403)") report a refusal;
    # a bare 403 would also match a timestamp's milliseconds.
    refusals = re.findall(r".*(?:403, message|\(403\)|Forbidden|Not enough permissions).*", log)
    assert not refusals, "\n".join(refusals[:10])
    # It serves its metrics where the chart told it to: the pod's IP, the `metrics` port.
    assert f"serving metrics at {operator['status']['podIP']}:9401/metrics" in log
    # It leads, holding the Lease the chart named, which its Role lets it create and renew.
    lease = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{kube.namespace}/leases/"
                     f"{_account(release)}")  # fmt: skip
    assert lease is not None
    assert lease["spec"]["holderIdentity"].split("_")[0] == operator["metadata"]["name"]
    # No finalizer holds the job; the workers go with their owner.
    kube.kubectl("delete", "etj", "tiny", "--timeout=60s")
    wait_until(lambda: not kube.pods("liveshard.io/job=tiny"), 60, "the job's workers gone")


def test_operator_dockerfile_matches_the_chart() -> None:
    """Nothing here runs Docker; this checks what would break the image silently: a source path
    that moved, a user other than the chart's, an entry point other than the chart's command."""
    dockerfile = (ROOT / "docker" / "operator.Dockerfile").read_text().splitlines()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for line in dockerfile:
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), f"{line!r}: {source} is not in the repository"
    assert 'RUN /opt/liveshard/bin/pip install ".[operator]" \\' in dockerfile
    user = values["podSecurityContext"]["runAsUser"]
    assert [line for line in dockerfile if line.startswith("USER ")] == [f"USER {user}:{user}"]
    entrypoint = [line for line in dockerfile if line.startswith("ENTRYPOINT ")]
    assert entrypoint == [f"ENTRYPOINT {json.dumps(values['operator']['command'])}"]
