"""The job contract is written once: every training setting is a field of `TrainingSettings`, a
property of the CRD's `spec.training` (or of the section its `crd` metadata names:
`spec.parallelism.pipelineSchedule`) and a flag of `liveshard-local`, and a job's configuration
travels CRD -> operator -> agent and flags -> launcher unchanged. No process, no cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from liveshard_core.errors import InvalidInput
from liveshard_core.job import Cause, Deadlines, JobConfig, Result, TrainingSettings
from liveshard_core.job.flags import flag
from liveshard_core.job.settings import FREEZE_KEYS, camel, setting_type

ROOT = Path(__file__).resolve().parents[3]
SCHEMA_TYPES = {int: "integer", float: "number", str: "string", tuple: "array"}
# Defaults the CRD sets apart from the settings' own, on purpose: on Kubernetes a micro-batch is
# one sample unless the job says otherwise.
CRD_DEFAULTS = {"micro_batch": 1}
# A value for every setting, none of them its default, all consistent with each other.
CHANGED: dict[str, Any] = {
    "global_batch": 12, "micro_batch": 3, "seq_len": 32, "steps": 7, "seed": 5, "lr": 0.01,
    "min_lr": 0.002, "warmup_steps": 3, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.9,
    "eps": 1e-6, "clip_norm": 0.5, "dropout": 0.1, "aux_loss_coef": 0.02, "data": "/data/text",
    "tokenizer": "/data/tokenizer.json", "data_order": "sequential", "pipeline_schedule": "gpipe",
    "freeze": ((2, 1), (4, 2)),
}  # fmt: skip


def section_schema(section: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "elastictrainingjobs.liveshard.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return dict(spec["properties"][section]["properties"])


def crd_sections(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Settings by field name as the CRD's spec holds them: `{section: {camelCase: value}}`."""
    sections: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(TrainingSettings):
        if f.name in values:
            value = values[f.name]
            if setting_type(f.type) is tuple:  # a list of {step, layers} objects
                value = [dict(zip(FREEZE_KEYS, entry, strict=True)) for entry in value]
            sections.setdefault(f.metadata["crd"], {})[camel(f.name)] = value
    return sections


def test_every_setting_is_a_crd_property_of_its_type_and_default() -> None:
    settings = dataclasses.fields(TrainingSettings)
    assert sorted(section_schema("training")) == sorted(
        camel(f.name) for f in settings if f.metadata["crd"] == "training"
    )
    for f in settings:
        prop = section_schema(f.metadata["crd"])[camel(f.name)]
        assert prop["type"] == SCHEMA_TYPES[setting_type(f.type)], f.name
        assert prop.get("enum") == (
            list(f.metadata["choices"]) if "choices" in f.metadata else None
        )
        if "default" in prop:
            assert prop["default"] == CRD_DEFAULTS.get(f.name, f.default), f.name
        else:  # no default: the settings' own applies, or the setting is required
            assert f.name not in CRD_DEFAULTS, f.name


def test_every_setting_was_changed_by_the_round_trips() -> None:
    defaults = TrainingSettings()
    assert sorted(CHANGED) == sorted(f.name for f in dataclasses.fields(TrainingSettings))
    assert all(getattr(defaults, name) != value for name, value in CHANGED.items())


def test_a_job_travels_from_the_crd_through_the_operator_to_the_agent() -> None:
    from liveshard_operator.spec import DEADLINE_FIELDS, JobSpec

    from liveshard_agent.server.config import load

    spec = {
        "replicas": 2, "model": {"preset": "tiny", "precision": "bf16"}, "device": "cpu",
        **crd_sections(CHANGED),
        "reconfiguration": {"memoryBudget": "8Mi", **{key: 10.0 * (i + 1) for i, key in
                                                      enumerate(DEADLINE_FIELDS.values())}},
    }  # fmt: skip
    job = JobSpec.parse(spec)
    assert job.training == TrainingSettings(**CHANGED)
    assert job.deadlines == Deadlines(op=10.0, switch=20.0, prepare=30.0)
    assert job.budget_bytes == 8 << 20 and job.config.precision == "bf16"
    environ = {
        "LIVESHARD_JOB": "j", "LIVESHARD_MEMBER": "m", "LIVESHARD_POD_IP": "127.0.0.1",
        "LIVESHARD_TOKEN": "t", "LIVESHARD_CONFIG": job.agent_config(),
    }  # fmt: skip
    assert load(environ, []).job_config == job.config


def test_a_job_travels_from_the_flags_to_the_launcher() -> None:
    pytest.importorskip("torch", reason="the launcher needs torch (the agent extra)")
    from liveshard_agent.local.launcher import _parser, job_from_args

    argv = ["--device", "cpu", "--nprocs", "3", "--layout", "dp=3"]
    for name, value in CHANGED.items():
        if name == "freeze":  # one flag per entry
            argv += [arg for step, layers in value for arg in (flag(name), f"{step}:{layers}")]
        else:
            argv += [flag(name), str(value)]
    job = job_from_args(_parser().parse_args(argv))
    assert job.settings == TrainingSettings(**CHANGED)
    assert job.config == JobConfig.from_json(job.config.to_json())


def test_settings_errors_name_the_field_as_each_side_spells_it() -> None:
    with pytest.raises(InvalidInput, match=r"spec\.training\.microBatch=5 must divide globalBatch"):
        TrainingSettings.from_dict({"globalBatch": 24, "microBatch": 5}, "spec.training", camel)
    with pytest.raises(InvalidInput, match=r"training\.seqLen='x' must be an integer"):
        TrainingSettings.from_dict({"seqLen": "x"}, "training", camel)
    with pytest.raises(InvalidInput, match=r"unknown field\(s\) \['nope'\]"):
        TrainingSettings.from_dict({"nope": 1})
    # A setting the CRD holds outside spec.training, named where it is.
    with pytest.raises(InvalidInput, match=r"^spec\.parallelism\.pipelineSchedule='2f2b' must be "
                       r"one of \['gpipe', '1f1b'\]$"):  # fmt: skip
        TrainingSettings.from_crd({"parallelism": {"tp": 2, "pipelineSchedule": "2f2b"}})
    with pytest.raises(InvalidInput, match=r"spec\.parallelism\.pipelineSchedule=1 must be a str"):
        TrainingSettings.from_crd({"parallelism": {"pipelineSchedule": 1}})
    with pytest.raises(InvalidInput, match=r"spec\.training: unknown field\(s\) \['pipelineSch"):
        TrainingSettings.from_crd({"training": {"pipelineSchedule": "gpipe"}})
    assert TrainingSettings.from_crd({"parallelism": {"tp": 2}}).pipeline_schedule == "1f1b"


def test_min_lr_defaults_to_a_tenth_of_lr() -> None:
    assert TrainingSettings(lr=0.02).min_lr == pytest.approx(0.002)
    assert TrainingSettings(lr=0.02, min_lr=0.0).learning_rate(10**6) == 0.0


def test_outcomes_are_the_protos_by_name() -> None:
    pb = pytest.importorskip("liveshard.v1.agent_pb2", reason="the generated contract")
    results, causes = pb.SwitchSummary.Result.keys(), pb.SwitchSummary.Cause.keys()
    assert ["RESULT_UNSPECIFIED"] + [r.name for r in Result] == results
    assert ["CAUSE_UNSPECIFIED"] + [c.name for c in Cause] == causes
    assert {c for c in Cause if c.permanent} == {Cause.NO_COMMON_STATE, Cause.NO_SURVIVING_COPY}
