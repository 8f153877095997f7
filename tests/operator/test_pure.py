"""The operator's pure parts: the job spec, rendered objects, the layout choice, conditions."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from liveshard_operator import conditions, policy, render
from liveshard_operator.spec import JobSpec, parse_quantity
from liveshard_operator.world import World

from liveshard.layouts import to_message
from liveshard_core.errors import InvalidInput
from liveshard_core.job import Deadlines, JobConfig
from tests.operator.values import BODY

# The tables' job, with the default deadlines and a template the rendering must keep.
JOB = copy.deepcopy(BODY)
JOB["spec"]["reconfiguration"] = {"memoryBudget": "64Mi"}
JOB["spec"]["template"] = {
    "metadata": {"labels": {"team": "a"}},
    "spec": {"containers": [{"name": "agent", "command": ["liveshard-agent"],
                             "env": [{"name": "X", "value": "1"}]}]},
}  # fmt: skip


def test_a_hugging_face_directory_reaches_the_agents_by_its_path(tmp_path: Path) -> None:
    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    body = copy.deepcopy(JOB["spec"])
    body["model"] = {"path": str(tmp_path), "init": "random"}
    body["training"] |= {"tokenizer": "/t/tokenizer.json", "dataOrder": "sequential"}
    spec = JobSpec.parse(body)
    sent = json.loads(spec.agent_config())
    assert sent["model"] == {"path": str(tmp_path), "init": "random"}
    assert (sent["training"]["tokenizer"], sent["training"]["data_order"]) == (
        "/t/tokenizer.json", "sequential")  # fmt: skip
    assert spec.model_spec().config.qk_norm and spec.model_spec().config.layers == 4
    assert JobConfig.from_json(spec.agent_config()) == spec.config


def test_spec_parses_with_defaults_and_agent_config() -> None:
    spec = JobSpec.parse(JOB["spec"])
    assert (spec.replicas, spec.min_replicas, spec.max_replicas) == (4, 1, 8)
    assert spec.device == "cpu" and spec.budget_bytes == 64 << 20
    assert spec.deadlines == Deadlines(op=30.0, switch=120.0, prepare=300.0)
    config = json.loads(spec.agent_config())
    assert config["model"] == {"preset": "tiny"} and config["training"]["global_batch"] == 24
    assert config["training"]["pipeline_schedule"] == "1f1b"  # the default
    gpipe = JobSpec.parse({**JOB["spec"], "parallelism": {"pipelineSchedule": "gpipe"}})
    assert json.loads(gpipe.agent_config())["training"]["pipeline_schedule"] == "gpipe"
    # On CPU the model trains in fp32 without a master copy, as the agents build it.
    assert spec.model_spec().config.param_dtype.value == "fp32"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"model": {"preset": "nope"}}, "unknown model 'nope'"),
        ({"model": {"preset": "tiny", "spec": {}}}, "exactly one of preset, spec and path"),
        ({"model": {"spec": {"name": "m", "vocab": 8}}}, "missing required field"),
        ({"reconfiguration": {"memoryBudget": "lots"}}, "memoryBudget='lots'"),
        ({"parallelism": {"tp": 3}}, "spec.parallelism: layout: tp=3 must divide heads=4 of tiny"),
        ({"parallelism": {"ep": 2}}, "ep=2 must divide the number of experts"),
        ({"parallelism": {"pipelineSchedule": "2f2b"}}, "spec.parallelism.pipelineSchedule='2f2b'"),
    ],
)
def test_bad_specs_name_the_field(change: dict, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        JobSpec.parse({**JOB["spec"], **change})


def test_quantities() -> None:
    assert parse_quantity("256Mi", "f") == 256 << 20
    assert parse_quantity("2G", "f") == 2 * 10**9
    assert parse_quantity(1024, "f") == 1024


def test_worker_pod_runs_the_agent_with_its_environment() -> None:
    spec = JobSpec.parse(JOB["spec"])
    pod = render.worker_pod(JOB, spec)
    assert pod["metadata"]["generateName"] == "tiny-"
    assert pod["metadata"]["labels"] == {"team": "a", "liveshard.io/job": "tiny",
                                         "liveshard.io/role": "standby"}  # fmt: skip
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    agent = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in agent["env"]}
    assert env["X"]["value"] == "1"  # the user's own environment comes first and stays
    assert env["LIVESHARD_MEMBER"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["LIVESHARD_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["LIVESHARD_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "tiny-token",
                                                                   "key": "token"}  # fmt: skip
    assert json.loads(env["LIVESHARD_CONFIG"]["value"]) == json.loads(spec.agent_config())
    assert pod["spec"]["restartPolicy"] == "Never"
    # The grace period outlasts a prepare and a switch: a leaving pod's state can move out.
    assert pod["spec"]["terminationGracePeriodSeconds"] > 300 + 120
    assert JOB["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}]


def test_worker_pods_are_restricted_and_get_no_api_credential_unless_the_template_says() -> None:
    pod = render.worker_pod(JOB, JobSpec.parse(JOB["spec"]))["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip
    assert pod["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }  # fmt: skip
    # The root filesystem read-only, /tmp is the pod's scratch space.
    assert pod["containers"][0]["volumeMounts"] == [{"name": "liveshard-tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "liveshard-tmp", "emptyDir": {}}]
    # A template that mounts its own /tmp keeps it.
    job = copy.deepcopy(JOB)
    agent = job["spec"]["template"]["spec"]["containers"][0]
    agent["volumeMounts"] = [{"name": "scratch", "mountPath": "/tmp"}]
    job["spec"]["template"]["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    pod = render.worker_pod(job, JobSpec.parse(job["spec"]))["spec"]
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert [v["name"] for v in pod["volumes"]] == ["scratch"]
    job = copy.deepcopy(JOB)
    template = job["spec"]["template"]["spec"]
    template.update(automountServiceAccountToken=True, securityContext={"runAsUser": 1000})
    template["containers"][0]["securityContext"] = {"privileged": True}
    pod = render.worker_pod(job, JobSpec.parse(job["spec"]))["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"] == {"runAsUser": 1000}
    assert pod["containers"][0]["securityContext"] == {"privileged": True}
    assert "volumes" not in pod  # the template's own security context: no scratch volume


def test_worker_pods_prefer_to_spread_over_nodes_unless_the_template_says() -> None:
    pod = render.worker_pod(JOB, JobSpec.parse(JOB["spec"]))["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a preference: never left Pending
    assert spread["labelSelector"] == {"matchLabels": {"liveshard.io/job": "tiny"}}
    job = copy.deepcopy(JOB)
    job["spec"]["template"]["spec"]["topologySpreadConstraints"] = []
    assert (
        render.worker_pod(job, JobSpec.parse(job["spec"]))["spec"]["topologySpreadConstraints"]
        == []
    )


@pytest.mark.parametrize(
    ("resources", "env", "threads"),
    [
        ({}, [], None),  # nothing said: torch's own default
        ({"requests": {"cpu": "100m"}}, [], "1"),
        ({"requests": {"cpu": "1500m"}, "limits": {"cpu": "3"}}, [], "3"),
        ({"requests": {"cpu": "2"}, "limits": None}, [], "2"),
        ({"limits": {"cpu": "lots"}}, [], None),
        ({"requests": {"cpu": "4"}}, [{"name": "OMP_NUM_THREADS", "value": "8"}], "8"),
    ],
)
def test_torch_threads_follow_the_containers_cpus(resources: dict, env: list, threads: str) -> None:
    job = copy.deepcopy(JOB)
    job["spec"]["template"]["spec"]["containers"][0].update(resources=resources, env=env)
    agent = render.worker_pod(job, JobSpec.parse(job["spec"]))["spec"]["containers"][0]
    values = [e["value"] for e in agent["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert values == ([] if threads is None else [threads])


def test_secret_and_budget() -> None:
    secret = render.token_secret(JOB)
    assert len(secret["stringData"]["token"]) == 64
    assert secret["stringData"]["token"] != render.token_secret(JOB)["stringData"]["token"]
    pdb = render.disruption_budget(JOB)
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"liveshard.io/job": "tiny"}},
    }
    assert render.selector("tiny") == "liveshard.io/job=tiny,liveshard.io/role=member"


def test_network_policy_lets_only_the_jobs_workers_and_the_operator_in() -> None:
    spec = JobSpec.parse({**JOB["spec"], "port": 7171})
    operator = render.Isolation("ops", {"app": "liveshard-operator"})
    policy = render.network_policy(JOB, spec, operator)
    assert policy["metadata"]["name"] == "tiny"
    assert policy["metadata"]["ownerReferences"] == [render.owner(JOB)]
    workers = {"podSelector": {"matchLabels": {"liveshard.io/job": "tiny"}}}
    assert policy["spec"] == {
        **workers,
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [workers]},  # every port: the agents, the c10d stores, the collectives
            {
                "from": [{
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                    "podSelector": {"matchLabels": {"app": "liveshard-operator"}},
                }],
                "ports": [{"protocol": "TCP", "port": 7171}],
            },
            {"ports": [{"protocol": "TCP", "port": 9400}]},  # metrics, from anyone
        ],
    }  # fmt: skip
    scrapers = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    limited = render.network_policy(JOB, spec, render.Isolation("ops", {"a": "b"}, scrapers))
    assert limited["spec"]["ingress"][2] == {
        "ports": [{"protocol": "TCP", "port": 9400}], "from": scrapers,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("members", "used", "dp"),
    [(4, 4, 4), (3, 3, 3), (5, 4, 4), (1, 1, 1), (8, 8, 4), (7, 6, 6)],
)
def test_policy_uses_the_most_members_the_global_batch_allows(
    members: int, used: int, dp: int
) -> None:
    spec = JobSpec.parse(JOB["spec"])  # global batch 24, micro-batch 2: dp must divide 12
    choice = policy.choose(spec.model_spec(), spec, members)
    assert (choice.used, choice.degrees.dp) == (used, dp)


def test_policy_keeps_fixed_degrees_and_says_when_nothing_fits() -> None:
    spec = JobSpec.parse({**JOB["spec"], "parallelism": {"tp": 2, "zero": 1}})
    choice = policy.choose(spec.model_spec(), spec, 5)
    assert (choice.used, choice.degrees.tp, choice.degrees.dp) == (4, 2, 2)
    fixed = JobSpec.parse({**JOB["spec"], "parallelism": {"tp": 2, "pp": 2}})
    with pytest.raises(InvalidInput, match="no layout of at most 3 members fits tiny"):
        policy.choose(fixed.model_spec(), fixed, 3)


def test_snapshots_mirror_zero_shards_wherever_a_layout_can() -> None:
    body = {k: v for k, v in JOB["spec"].items() if k != "faultTolerance"}
    spec = JobSpec.parse(body)  # on by default
    model = spec.model_spec()
    assert spec.snapshots
    four = policy.choose(model, spec, 4).degrees
    assert (four.dp, four.zero, four.mirror) == (4, 1, True)
    assert not policy.choose(model, spec, 1).degrees.mirror  # dp=1: no other holder
    unsharded = JobSpec.parse({**body, "parallelism": {"zero": 0}})
    assert not policy.choose(model, unsharded, 4).degrees.mirror
    off = JobSpec.parse({**body, "faultTolerance": {"snapshots": False}})
    assert not policy.choose(model, off, 4).degrees.mirror
    # The record in the job's status keeps it, and so do the agents' layouts.
    world = World.of(3, four.layout(model, ["a", "b", "c", "d"]))
    assert World.from_dict(world.to_dict()) == world and world.to_dict()["mirror"] is True
    assert to_message(world.layout(model)).mirror
    held_once = policy.choose(model, off, 4).degrees.layout(model, ["a", "b", "c", "d"])
    # Written as false, not left out: the status is merge-patched, and a world that stops being
    # mirrored (a drain to dp=1) must not keep the last one's true.
    assert World.of(3, held_once).to_dict()["mirror"] is False and not to_message(held_once).mirror
    with pytest.raises(InvalidInput, match=r"spec.faultTolerance.snapshots='yes' must be true"):
        JobSpec.parse({**body, "faultTolerance": {"snapshots": "yes"}})


def test_conditions_move_on_flips_and_terminal_ones_stay() -> None:
    conds = conditions.Conditions([], generation=2)
    conds.set("Ready", True, "Running", "ok")
    first = dict(conds.get("Ready") or {})
    conds.set("Ready", True, "Running", "still ok")
    assert conds.get("Ready")["lastTransitionTime"] == first["lastTransitionTime"]  # type: ignore[index]
    assert conds.get("Ready")["observedGeneration"] == 2  # type: ignore[index]
    conds.set("Succeeded", True, "Trained", "done")
    conds.set("Succeeded", False, "Again", "no")
    assert conds.get("Succeeded")["status"] == "True" and conds.terminal()  # type: ignore[index]
