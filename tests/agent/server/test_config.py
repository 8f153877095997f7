"""The agent's configuration: parsing without a process, and bad configurations that make
`liveshard-agent` exit with status 2 and one line naming the variable and the field (each such
case starts one short-lived process, which exits before importing torch)."""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("grpc", reason="the agent's server needs grpc (the agent extra)")

from liveshard_agent.server.config import load
from liveshard_core.errors import InvalidInput
from liveshard_core.job import Deadlines, JobConfig
from liveshard_core.vps.spec import DType

from .agents import AGENT, CONFIG, agent_env


def test_a_full_configuration_is_parsed() -> None:
    """No process."""
    config = JobConfig.from_json(json.dumps({
        "model": {"spec": {"name": "m", "vocab": 64, "hidden": 32, "layers": 2, "heads": 2,
                           "kv_heads": 1, "head_dim": 16, "ffn": 64}},
        "precision": "bf16", "device": "cpu",
        "training": {"global_batch": 8, "micro_batch": 2, "steps": 7, "lr": 1, "data": None},
        "deadlines": {"op": 5, "switch": 10, "prepare": 20}, "budget_bytes": 1 << 20,
    }))  # fmt: skip
    assert config.model.name == "m" and config.training.steps == 7
    assert config.training.lr == 1.0 and isinstance(config.training.lr, float)
    assert config.deadlines == Deadlines(5.0, 10.0, 20.0)
    assert config.model_spec("cpu").config.param_dtype is DType.BF16  # a given precision wins
    tiny = JobConfig.from_json('{"model": {"preset": "tiny"}}')
    assert tiny.model_spec("cpu").config.param_dtype is DType.FP32  # CPU default: fp32, no master
    assert tiny.model_spec("cuda").config.param_dtype is DType.BF16  # the model's own on GPUs
    assert tiny.deadlines == Deadlines() and tiny.budget_bytes == 256 << 20


def test_flags_override_the_environment_but_the_token_has_none() -> None:
    """No process."""
    env = agent_env("a", 7070)
    config = load(env, ["--member", "b", "--port", "7171"])
    assert (config.member, config.port, config.job) == ("b", 7171, "test-job")
    assert config.token not in repr(config) and "token=" not in repr(config)  # never printed
    with pytest.raises(SystemExit):
        load(env, ["--token", "x"])


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[]", "expected a JSON object"),
        ("{", "not valid JSON"),
        ('{"model": {"preset": "tiny"}, "extra": 1}', "unknown field(s) ['extra']"),
        ("{}", "model: required"),
        ('{"model": {"preset": "tiny", "spec": {}}}', "model="),
        ('{"model": {"spec": {"name": "m"}}}', "model.spec: missing required field(s)"),
        ('{"model": {"preset": "tiny"}, "precision": "fp8"}', "precision='fp8'"),
        ('{"model": {"preset": "tiny"}, "device": "tpu"}', "device='tpu'"),
        ('{"model": {"preset": "tiny"}, "training": {"steps": "9"}}', "training.steps='9'"),
        ('{"model": {"preset": "tiny"}, "training": {"lr": true}}', "training.lr=True"),
        ('{"model": {"preset": "tiny"}, "training": {"warmup": 1}}', "training: unknown"),
        ('{"model": {"preset": "tiny"}, "training": {"micro_batch": 5}}',
         "training.micro_batch=5 must divide global_batch=24"),
        ('{"model": {"preset": "tiny"}, "deadlines": {"op": -1}}', "deadlines: op=-1.0"),
        ('{"model": {"preset": "tiny"}, "deadlines": {"op": 200}}', "deadlines: op=200.0 <="),
        ('{"model": {"preset": "tiny"}, "budget_bytes": 0}', "budget_bytes=0"),
    ],
)  # fmt: skip
def test_bad_job_configurations_name_the_field(text: str, names: str) -> None:
    """No process."""
    with pytest.raises(InvalidInput) as err:
        JobConfig.from_json(text)
    assert names in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ({"LIVESHARD_TOKEN": ""}, "LIVESHARD_TOKEN: required"),
        ({"LIVESHARD_TOKEN": "two words"}, "LIVESHARD_TOKEN: must be printable ASCII"),
        ({"LIVESHARD_MEMBER": ""}, "LIVESHARD_MEMBER: required"),
        ({"LIVESHARD_POD_IP": "pod-7"}, "LIVESHARD_POD_IP: 'pod-7' is not an IP address"),
        ({"LIVESHARD_PORT": "70000"}, "LIVESHARD_PORT: '70000' must be a port number"),
        ({"LIVESHARD_LOG_FORMAT": "xml"}, "LIVESHARD_LOG_FORMAT: 'xml' must be one of text, json"),
        ({"LIVESHARD_CONFIG": json.dumps({**CONFIG, "training": {"global_batch": 0}})},
         "LIVESHARD_CONFIG: training.global_batch=0 must be an integer >= 1"),
        ({"LIVESHARD_CONFIG": '{"model": {"preset": "huge"}}'},
         "LIVESHARD_CONFIG: model.preset: unknown model 'huge'"),
    ],
)  # fmt: skip
def test_a_bad_configuration_exits_2_with_one_line(overrides: dict[str, str], line: str) -> None:
    """1 process, which exits before importing torch."""
    env = agent_env("a0", 7070)
    env.update(overrides)
    done = subprocess.run([AGENT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"liveshard-agent: {line}"), done.stderr


CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
KEY = "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----"
TLS = {"LIVESHARD_TLS_CERT": CERT, "LIVESHARD_TLS_KEY": KEY, "LIVESHARD_TLS_CA": CERT}


def test_the_tls_variables_are_all_three_or_none() -> None:
    """No process."""
    assert load(agent_env("a", 7070), []).tls is None  # plaintext
    tls = load(agent_env("a", 7070, **TLS), []).tls
    assert tls is not None and tls.cert == tls.ca == CERT.encode() + b"\n"
    assert KEY not in repr(tls)  # the key is never printed
    for left_out in TLS:
        partial = {k: v for k, v in TLS.items() if k != left_out}
        with pytest.raises(InvalidInput, match=f"^{left_out}: required when any of"):
            load(agent_env("a", 7070, **partial), [])
    with pytest.raises(InvalidInput, match=r"^LIVESHARD_TLS_KEY: not a PEM private key"):
        load(agent_env("a", 7070, **{**TLS, "LIVESHARD_TLS_KEY": CERT}), [])
    with pytest.raises(InvalidInput, match=r"^LIVESHARD_TLS_CA: not a PEM certificate"):
        load(agent_env("a", 7070, **{**TLS, "LIVESHARD_TLS_CA": "/etc/ca.crt"}), [])
