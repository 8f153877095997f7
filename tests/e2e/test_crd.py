"""The ElasticTrainingJob CRD on a real API server: the examples validate and get their defaults,
invalid jobs are refused with a message naming the field, the scale and status subresources and
the printer columns behave as `kubectl scale` and `kubectl get etj` users expect, and the fields
fixed for a job's life stay fixed. Needs the local cluster; starts no pods. The first test checks
the CRD's model fields against the agent's model config and needs nothing."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from liveshard_core.vps.presets import CONFIGS
from liveshard_core.vps.spec import DType, TransformerConfig, config_from_dict
from liveshard_e2e.cluster import ClusterInfo
from liveshard_e2e.testing import Kube
from tests.e2e.deployment import API, crd_schema, example, install_crd


def test_model_spec_fields_are_those_of_the_agent_model_config() -> None:
    model = crd_schema()["properties"]["spec"]["properties"]["model"]["properties"]["spec"]
    fields = dataclasses.fields(TransformerConfig)
    assert set(model["properties"]) == {f.name for f in fields}
    assert set(model["required"]) == {f.name for f in fields if f.default is dataclasses.MISSING}
    assert set(model["properties"]["param_dtype"]["enum"]) == {d.value for d in DType}
    # The examples name models the agent accepts.
    assert example("tiny-job")["spec"]["model"]["preset"] in CONFIGS
    gpu_model = example("gpu-job")["spec"]["model"]["spec"]
    assert config_from_dict(gpu_model, "examples/gpu-job.yaml").layers == gpu_model["layers"]


@pytest.fixture(scope="module")
def jobs(local_cluster: ClusterInfo) -> Iterator[Kube]:
    """The CRD installed, and one namespace shared by this module's tests (each uses its own job
    names)."""
    admin = Kube(local_cluster)
    install_crd(admin)
    kube = admin.create_namespace(f"crd-tests-{uuid.uuid4().hex[:5]}")
    yield kube
    admin.run("kubectl", "delete", "namespace", kube.namespace, "--wait=false", check=False)


def _dry_run(kube: Kube, job: dict[str, Any]) -> tuple[int, str, str]:
    result = kube.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(job), check=False
    )
    return result.returncode, result.stdout, result.stderr


def test_examples_validate_and_get_their_defaults(jobs: Kube) -> None:
    rc, out, err = _dry_run(jobs, example("tiny-job"))
    assert rc == 0, err
    spec = json.loads(out)["spec"]
    assert spec["port"] == 7070
    assert spec["parallelism"] == {"zero": 1}
    assert spec["reconfiguration"] == {
        "memoryBudget": "256Mi",
        "opTimeoutSeconds": 30,
        "switchDeadlineSeconds": 120,
        "prepareDeadlineSeconds": 300,
    }
    assert spec["checkpoint"] == {"everySteps": 0}
    assert spec["training"] | {"steps": 0} == {
        "globalBatch": 24,
        "microBatch": 2,
        "seqLen": 64,
        "steps": 0,
        "seed": 0,
        "lr": 0.003,
        "dropout": 0,
        "warmupSteps": 10,
        "weightDecay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "clipNorm": 1.0,
        "auxLossCoef": 0.01,
        "dataOrder": "shuffled",
    }
    # No grace period by default: the operator derives one from the deadlines.
    assert "terminationGracePeriodSeconds" not in spec["template"]["spec"]
    assert spec["template"]["spec"]["containers"][0]["command"] == ["liveshard-agent"]

    # A memory budget may also be a plain number of bytes.
    job = example("tiny-job")
    job["spec"]["reconfiguration"] = {"memoryBudget": 268435456}
    rc, out, err = _dry_run(jobs, job)
    assert rc == 0, err
    assert json.loads(out)["spec"]["reconfiguration"]["memoryBudget"] == 268435456

    rc, out, err = _dry_run(jobs, example("gpu-job"))
    assert rc == 0, err
    spec = json.loads(out)["spec"]
    assert spec["device"] == "cuda" and spec["model"]["precision"] == "bf16"
    # Fields of the pod template the CRD does not describe are kept, not pruned.
    assert spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
    assert spec["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def _put(job: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = job
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value


_DELETE = object()


def _model(**fields: Any) -> dict[str, Any]:
    """A small valid model spec with ``fields`` changed, as ``spec.model``."""
    base = {"name": "m", "vocab": 8, "hidden": 8, "layers": 1, "heads": 4, "kv_heads": 2}
    return {"spec": base | {"head_dim": 4, "ffn": 8} | fields}


# (what is wrong, {path: value} applied to the tiny example, text the refusal must contain)
INVALID: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "replicas above max",
        {"spec.replicas": 9},
        ["spec.replicas (9) must be between spec.minReplicas (1) and spec.maxReplicas (8)"],
    ),
    (
        "replicas below min",
        {"spec.minReplicas": 2, "spec.replicas": 1},
        ["spec.replicas (1) must be between spec.minReplicas (2)"],
    ),
    ("replicas zero", {"spec.replicas": 0}, ["to stop a job for a while, set spec.suspend: true"]),
    (
        "suspend without a checkpoint path",
        {"spec.suspend": True},
        ["spec.suspend needs spec.checkpoint.path"],
    ),
    ("replicas negative", {"spec.replicas": -1}, ["spec.replicas", "greater than or equal to 0"]),
    (
        "history limit negative",
        {"spec.faultTolerance.failedPodsHistoryLimit": -1},
        ["spec.faultTolerance.failedPodsHistoryLimit", "greater than or equal to 0"],
    ),
    (
        "min above max",
        {"spec.minReplicas": 9},
        ["spec.minReplicas (9) must not exceed spec.maxReplicas (8)"],
    ),
    ("max missing", {"spec.maxReplicas": _DELETE}, ["spec.maxReplicas: Required value"]),
    ("unknown spec field", {"spec.trainingg": {"steps": 1}}, ['unknown field "spec.trainingg"']),
    (
        "unknown nested field",
        {"spec.training.epochs": 3},
        ['unknown field "spec.training.epochs"'],
    ),
    (
        "unknown status-like field in spec",
        {"spec.parallelism.dp": 2},
        ['unknown field "spec.parallelism.dp"'],
    ),
    (
        "preset and spec",
        {"spec.model.spec": {**dataclasses.asdict(CONFIGS["tiny"]), "param_dtype": "fp32"}},
        ["spec.model needs exactly one of model.preset, model.spec and model.path"],
    ),
    (
        "neither preset nor spec",
        {"spec.model.preset": _DELETE, "spec.model.precision": "bf16"},
        ["spec.model needs exactly one of model.preset, model.spec and model.path"],
    ),
    (
        "init without a model directory",
        {"spec.model.init": "random"},
        ["spec.model.init needs spec.model.path"],
    ),
    (
        "a data order that does not exist",
        {"spec.training.dataOrder": "random"},
        ['spec.training.dataOrder: Unsupported value: "random"'],
    ),
    (
        "model spec with an unknown field",
        {"spec.model": _model(hiden=8)},
        ['unknown field "spec.model.spec.hiden"'],
    ),
    (
        "kv_heads not dividing heads",
        {"spec.model": _model(kv_heads=3)},
        ["spec.model.spec.kv_heads (3) must divide spec.model.spec.heads (4)"],
    ),
    (
        "experts without expert_ffn",
        {"spec.model": _model(experts=4)},
        ["spec.model.spec.experts and expert_ffn must both be 0"],
    ),
    (
        "top_k above the number of experts",
        {"spec.model": _model(experts=4, expert_ffn=8, top_k=5)},
        ["spec.model.spec.top_k must not exceed experts"],
    ),
    ("model precision", {"spec.model.precision": "fp16"}, ["spec.model.precision", "fp16"]),
    (
        "steps negative",
        {"spec.training.steps": -5},
        ["spec.training.steps", "greater than or equal to 1"],
    ),
    ("steps missing", {"spec.training.steps": _DELETE}, ["spec.training.steps: Required value"]),
    (
        "micro-batch not dividing the global batch",
        {"spec.training.microBatch": 5},
        ["spec.training.microBatch (5) must divide spec.training.globalBatch (24)"],
    ),
    ("dropout of 1", {"spec.training.dropout": 1}, ["spec.training.dropout", "less than 1"]),
    ("lr of 0", {"spec.training.lr": 0}, ["spec.training.lr", "greater than 0"]),
    (
        "freeze entry without layers",
        {"spec.training.freeze": [{"step": 3}]},
        ["spec.training.freeze[0].layers: Required value"],
    ),
    ("tp of 0", {"spec.parallelism.tp": 0}, ["spec.parallelism.tp", "greater than or equal to 1"]),
    (
        "zero stage 2",
        {"spec.parallelism.zero": 2},
        ["spec.parallelism.zero", "Unsupported value: 2"],
    ),
    (
        "pipeline schedule unknown",
        {"spec.parallelism.pipelineSchedule": "2f2b"},
        ["spec.parallelism.pipelineSchedule", 'Unsupported value: "2f2b"'],
    ),
    (
        "fixed pp with ppMax",
        {"spec.parallelism.pp": 2, "spec.parallelism.ppMax": 4},
        ["spec.parallelism.ppMax bounds a free pp"],
    ),
    (
        "checkpoints without a path",
        {"spec.checkpoint.everySteps": 10},
        ["spec.checkpoint.everySteps > 0 needs spec.checkpoint.path"],
    ),
    (
        "an export without a checkpoint path",
        {"spec.checkpoint.exportTo": "/out/hf"},
        ["spec.checkpoint.exportTo needs spec.checkpoint.path"],
    ),
    (
        "an export to a relative path",
        {"spec.checkpoint": {"path": "/ck", "exportTo": "out/hf"}},
        ["spec.checkpoint.exportTo", "should match '^/'"],
    ),
    (
        "timeouts out of order",
        {"spec.reconfiguration": {"opTimeoutSeconds": 60, "switchDeadlineSeconds": 30}},
        ["opTimeoutSeconds (60) < switchDeadlineSeconds (30) < prepareDeadlineSeconds (300)"],
    ),
    (
        "grace period shorter than the prepare deadline",
        {"spec.template.spec.terminationGracePeriodSeconds": 30},
        [
            "spec.template.spec.terminationGracePeriodSeconds (30) must exceed "
            "spec.reconfiguration.prepareDeadlineSeconds (300)"
        ],
    ),
    (
        "memory budget not a quantity",
        {"spec.reconfiguration.memoryBudget": "lots"},
        ["spec.reconfiguration.memoryBudget must be a positive number of bytes or a quantity"],
    ),
    (
        "memory budget of zero",
        {"spec.reconfiguration.memoryBudget": "0Mi"},
        ["spec.reconfiguration.memoryBudget must be a positive number of bytes or a quantity"],
    ),
    (
        "memory budget as a fraction",
        {"spec.reconfiguration.memoryBudget": "1.5Gi"},
        ["spec.reconfiguration.memoryBudget must be a positive number of bytes or a quantity"],
    ),
    (
        "memory budget as a negative number",
        {"spec.reconfiguration.memoryBudget": -1},
        ["spec.reconfiguration.memoryBudget", "greater than or equal to 1"],
    ),
    ("device tpu", {"spec.device": "tpu"}, ["spec.device", 'Unsupported value: "tpu"']),
    ("port out of range", {"spec.port": 70000}, ["spec.port", "less than or equal to 65535"]),
    ("template missing", {"spec.template": _DELETE}, ["spec.template: Required value"]),
    (
        "template without containers",
        {"spec.template.spec.containers": []},
        ["spec.template.spec.containers", "should have at least 1 items"],
    ),
    (
        "name longer than a worker's label allows",
        {"metadata.name": "j" * 49},
        ["metadata.name must be at most 48 characters"],
    ),
]


@pytest.mark.parametrize(
    ("changes", "expected"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_job_is_refused_naming_the_problem(
    jobs: Kube, changes: dict[str, Any], expected: list[str]
) -> None:
    job = example("tiny-job")
    for path, value in changes.items():
        _put(job, path, value)
    rc, _, err = _dry_run(jobs, job)
    assert rc != 0, f"the API server accepted {changes}"
    for text in expected:
        assert text in err, f"{text!r} not in the refusal:\n{err}"


def _job(kube: Kube, name: str) -> dict[str, Any]:
    body = kube.get(f"{API}/namespaces/{kube.namespace}/elastictrainingjobs/{name}")
    assert body is not None, f"job {name} missing"
    return body


def _create(kube: Kube, name: str) -> dict[str, Any]:
    job = example("tiny-job")
    job["metadata"]["name"] = name
    kube.apply(job)
    return _job(kube, name)


def test_scale_subresource_moves_spec_replicas_within_bounds(jobs: Kube) -> None:
    _create(jobs, "scaled")
    jobs.kubectl("scale", "etj/scaled", "--replicas=2")
    assert _job(jobs, "scaled")["spec"]["replicas"] == 2
    refused = jobs.kubectl("scale", "etj/scaled", "--replicas=9", check=False)
    assert refused.returncode != 0
    assert "spec.replicas (9) must be between" in refused.stderr
    assert _job(jobs, "scaled")["spec"]["replicas"] == 2

    # What the operator reports is what /scale (kubectl scale, an HPA) reads back.
    selector = "liveshard.io/job=scaled,liveshard.io/role=member"
    jobs.kubectl(
        "patch", "etj/scaled", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"replicas": 2, "selector": selector}}),
    )  # fmt: skip
    scale = jobs.get(f"{API}/namespaces/{jobs.namespace}/elastictrainingjobs/scaled/scale")
    assert scale is not None
    assert scale["kind"] == "Scale"
    assert scale["spec"] == {"replicas": 2}
    assert scale["status"] == {"replicas": 2, "selector": selector}


STATUS = {
    "phase": "Running",
    "replicas": 3,
    "readyReplicas": 3,
    "selector": "liveshard.io/job=reported,liveshard.io/role=member",
    "epoch": 4,
    "step": 1200,
    "loss": 2.75,
    "layout": "dp=3,tp=1,pp=1,zero=1",
    "members": ["reported-a", "reported-b", "reported-c"],
    "spares": ["reported-d"],
    "lastReconfiguration": {
        "epoch": 4,
        "reason": "ScaleDown",
        "from": "dp=2,tp=2,pp=1,zero=1",
        "to": "dp=3,tp=1,pp=1,zero=1",
        "pauseSeconds": 0.93,
        "bytesMoved": 971000000,
        "result": "committed",
        "message": "",
    },
    "reconfiguration": {"epoch": 5, "phase": "preparing", "members": ["reported-a"]},
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Training",
            "message": "3 members train in dp=3",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": 1,
        }
    ],
    "observedGeneration": 1,
}


def test_status_holds_the_operator_record_and_shows_in_kubectl_get(jobs: Kube) -> None:
    created = _create(jobs, "reported")
    status_patch = ["--subresource=status", "--type=merge"]
    jobs.kubectl("patch", "etj/reported", *status_patch, "-p", json.dumps({"status": STATUS}))
    job = _job(jobs, "reported")
    assert job["status"] == STATUS
    # Status writes do not count as spec changes.
    assert job["metadata"]["generation"] == created["metadata"]["generation"]

    table = jobs.kubectl("get", "etj", "reported").stdout.splitlines()
    assert table[0].split() == [
        "NAME", "PHASE", "REPLICAS", "LAYOUT", "STEP", "LOSS", "LAST", "PAUSE", "AGE",
    ]  # fmt: skip
    assert table[1].split()[:7] == [
        "reported", "Running", "3", "dp=3,tp=1,pp=1,zero=1", "1200", "2.75", "0.93",
    ]  # fmt: skip
    wide = jobs.kubectl("get", "etj", "reported", "-o", "wide").stdout.splitlines()
    assert "DESIRED" in wide[0] and "EPOCH" in wide[0]

    # A status written through the main resource is ignored (only /status writes it).
    job["status"]["phase"] = "Failed"
    jobs.kubectl("replace", "-f", "-", input=json.dumps(job))
    assert _job(jobs, "reported")["status"]["phase"] == "Running"

    for wrong, text in [
        ({"phase": "Degraded"}, 'status.phase: Unsupported value: "Degraded"'),
        ({"conditions": [{"type": "Ready", "status": "True"}]}, "status.conditions[0].reason"),
        (
            {"conditions": [{**STATUS["conditions"][0], "status": "yes"}]},  # type: ignore[dict-item]
            'status.conditions[0].status: Unsupported value: "yes"',
        ),
    ]:
        refused = jobs.kubectl(
            "patch", "etj/reported", *status_patch, "-p", json.dumps({"status": wrong}),
            check=False,
        )  # fmt: skip
        assert refused.returncode != 0 and text in refused.stderr, refused.stderr


def test_fields_fixed_for_a_jobs_life_stay_fixed(jobs: Kube) -> None:
    _create(jobs, "fixed")
    for change, text in [
        ({"model": {"preset": "tiny-moe"}}, "spec.model is immutable"),
        ({"training": {"seed": 7}}, "only spec.training.steps may change"),
        ({"training": {"data": "/data/other.bin"}}, "only spec.training.steps may change"),
        ({"training": {"minLr": 0.0001}}, "only spec.training.steps may change"),
        ({"training": {"weightDecay": 0.0}}, "only spec.training.steps may change"),
        (
            {"training": {"freeze": [{"step": 5, "layers": 1}]}},
            "only spec.training.steps may change",
        ),
        ({"port": 7071}, "spec.port is immutable"),
        ({"device": "cuda"}, "spec.device is immutable"),
        (
            {"parallelism": {"pipelineSchedule": "gpipe"}},
            "spec.parallelism.pipelineSchedule is fixed for the life of a job",
        ),
    ]:
        refused = jobs.kubectl(
            "patch", "etj/fixed", "--type=merge", "-p", json.dumps({"spec": change}), check=False
        )
        assert refused.returncode != 0 and text in refused.stderr, (change, refused.stderr)

    # What may change: the length of training, the size, its bounds, the parallel constraints.
    allowed = {
        "training": {"steps": 50},
        "replicas": 6,
        "maxReplicas": 6,
        "parallelism": {"tp": 2},
    }
    jobs.kubectl("patch", "etj/fixed", "--type=merge", "-p", json.dumps({"spec": allowed}))
    spec = _job(jobs, "fixed")["spec"]
    assert spec["training"]["steps"] == 50
    assert (spec["replicas"], spec["maxReplicas"], spec["parallelism"]["tp"]) == (6, 6, 2)
