"""The agent process's configuration: environment variables, overridable by flags (never the
token: a secret on the command line is visible to every process on the node).

    LIVESHARD_JOB      the job's name
    LIVESHARD_MEMBER   this agent's member name (the pod's name)
    LIVESHARD_POD_IP   the address it serves on and hosts stores on (the pod's IP)
    LIVESHARD_PORT     the API's port (default 7070)
    LIVESHARD_TOKEN    the job's token; every call must carry it
    LIVESHARD_CONFIG   JSON: what the job trains and how it switches (`parse_job_config`)

Parsing imports no torch, so a bad configuration is reported in a moment. Every error is a
`ConfigError` whose one-line message names the variable (and the field inside LIVESHARD_CONFIG).
This module owns parsing and checking; it must not start anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from liveshard_core.errors import InvalidInput
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import DType, ModelSpec, TransformerConfig, config_from_dict

from ..runtime.settings import TrainingSettings

DEFAULT_PORT = 7070
DEFAULT_BUDGET = 256 << 20
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda")
_CONFIG_KEYS = ("model", "precision", "device", "training", "deadlines", "budget_bytes")


class ConfigError(InvalidInput):
    """A configuration the agent cannot start with; the message names the variable and field."""


@dataclass(frozen=True)
class Deadlines:
    """Seconds: collective op < switch (transfer and vote) < prepare, as DESIGN.md section 7."""

    op: float = 30.0
    switch: float = 120.0
    prepare: float = 300.0

    def __post_init__(self) -> None:
        for name in ("op", "switch", "prepare"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise InvalidInput(f"{name}={value!r} must be a positive number of seconds")
        if not self.op <= self.switch <= self.prepare:
            raise InvalidInput(
                f"op={self.op} <= switch={self.switch} <= prepare={self.prepare} must hold"
            )


@dataclass(frozen=True)
class JobConfig:
    """LIVESHARD_CONFIG: the same on every agent of a job."""

    model: TransformerConfig
    precision: str | None = None  # None: fp32 on CPU, the model's own on GPUs
    device: str | None = None  # None: cuda when a GPU is visible, else cpu
    training: TrainingSettings = field(default_factory=TrainingSettings)
    deadlines: Deadlines = field(default_factory=Deadlines)
    budget_bytes: int = DEFAULT_BUDGET

    def spec(self, device_type: str) -> ModelSpec:
        """The model as every agent of the job builds it (as the operator and `liveshard-local`
        do: fp32 parameters without a master copy on CPU unless a precision is given)."""
        precision = self.precision or ("fp32" if device_type == "cpu" else None)
        config = self.model
        if precision is not None and config.param_dtype is not DType(precision):
            config = dataclasses.replace(config, param_dtype=DType(precision))
        return ModelSpec.from_config(config)


@dataclass(frozen=True)
class AgentConfig:
    job: str
    member: str
    pod_ip: str
    port: int
    token: str = field(repr=False)
    job_config: JobConfig

    @property
    def address(self) -> str:
        """The address gRPC binds: the pod IP, never a wildcard (pods on the local cluster
        share one port space)."""
        host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip
        return f"{host}:{self.port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liveshard-agent",
        description="The agent of one worker pod: trains its part of the job and serves the "
        "liveshard.v1.Agent API. Configured by LIVESHARD_* environment variables; these flags "
        "override them (the token has no flag: set LIVESHARD_TOKEN).",
    )
    parser.add_argument("--job", help="the job's name (LIVESHARD_JOB)")
    parser.add_argument("--member", help="this agent's member name (LIVESHARD_MEMBER)")
    parser.add_argument("--pod-ip", help="the address to serve on (LIVESHARD_POD_IP)")
    parser.add_argument("--port", help=f"the API's port (LIVESHARD_PORT, {DEFAULT_PORT})")
    parser.add_argument("--config", help="the job's JSON configuration (LIVESHARD_CONFIG)")
    return parser


def load(environ: Mapping[str, str], argv: list[str] | None = None) -> AgentConfig:
    """The configuration from `environ` and the command line; ConfigError if any is wrong."""
    args = _parser().parse_args(argv)

    def value(variable: str, flag: str | None, default: str | None = None) -> str:
        got = flag if flag is not None else environ.get(variable, default)
        if got is None or not got.strip():
            raise ConfigError(f"{variable}: required, and not set")
        return got.strip()

    job = value("LIVESHARD_JOB", args.job)
    member = value("LIVESHARD_MEMBER", args.member)
    pod_ip = value("LIVESHARD_POD_IP", args.pod_ip)
    try:
        ipaddress.ip_address(pod_ip)
    except ValueError:
        raise ConfigError(f"LIVESHARD_POD_IP: {pod_ip!r} is not an IP address") from None
    port_text = value("LIVESHARD_PORT", args.port, str(DEFAULT_PORT))
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"LIVESHARD_PORT: {port_text!r} must be a port number in 1..65535")
    token = environ.get("LIVESHARD_TOKEN", "")
    if not token:
        raise ConfigError("LIVESHARD_TOKEN: required, and not set (the job's token)")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        # gRPC metadata carries printable ASCII only: a client could never present it.
        raise ConfigError("LIVESHARD_TOKEN: must be printable ASCII without whitespace")
    try:
        job_config = parse_job_config(value("LIVESHARD_CONFIG", args.config))
    except InvalidInput as err:
        raise ConfigError(f"LIVESHARD_CONFIG: {err}") from None
    return AgentConfig(job, member, pod_ip, int(port_text), token, job_config)


def parse_job_config(text: str) -> JobConfig:
    """LIVESHARD_CONFIG's JSON:
    `{"model": {"preset": NAME} | {"spec": {TransformerConfig fields}}, "precision": null |
    "fp32" | "bf16", "device": null | "cpu" | "cuda", "training": {TrainingSettings fields},
    "deadlines": {"op": s, "switch": s, "prepare": s}, "budget_bytes": n}`; only `model` is
    required. Errors name the field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidInput(f"not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_CONFIG_KEYS))
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}; valid fields: {list(_CONFIG_KEYS)}")
    if "model" not in data:
        raise InvalidInput('model: required, e.g. {"preset": "tiny"}')
    return JobConfig(
        model=_model(data["model"]),
        precision=_choice(data.get("precision"), "precision", PRECISIONS),
        device=_choice(data.get("device"), "device", DEVICES),
        training=_training(data.get("training") or {}),
        deadlines=_deadlines(data.get("deadlines") or {}),
        budget_bytes=_budget(data.get("budget_bytes", DEFAULT_BUDGET)),
    )


def _model(data: Any) -> TransformerConfig:
    if not isinstance(data, dict) or len(data) != 1 or not {"preset", "spec"} >= set(data):
        raise InvalidInput(
            f'model={data!r} must be {{"preset": NAME}} or {{"spec": {{model fields}}}}'
        )
    if "preset" in data:
        if not isinstance(data["preset"], str):
            raise InvalidInput(f"model.preset={data['preset']!r} must be a string")
        try:
            return resolve_model(data["preset"]).config
        except InvalidInput as err:
            raise InvalidInput(f"model.preset: {err}") from None
    return config_from_dict(data["spec"], "model.spec")


def _choice(value: Any, name: str, valid: tuple[str, ...]) -> str | None:
    if value is not None and value not in valid:
        raise InvalidInput(f"{name}={value!r} must be null or one of {list(valid)}")
    return None if value is None else str(value)


def _training(data: Any) -> TrainingSettings:
    if not isinstance(data, dict):
        raise InvalidInput(f"training must be an object of settings, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(TrainingSettings)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise InvalidInput(f"training: unknown field(s) {unknown}; valid fields: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, raw in data.items():
        default = fields[name].default
        if default is None:  # the data file
            if raw is not None and not isinstance(raw, str):
                raise InvalidInput(f"training.{name}={raw!r} must be a path or null")
        elif isinstance(default, int):
            if type(raw) is not int:
                raise InvalidInput(f"training.{name}={raw!r} must be an integer")
        elif type(raw) not in (int, float) or not math.isfinite(raw):
            raise InvalidInput(f"training.{name}={raw!r} must be a number")
        else:
            raw = float(raw)
        values[name] = raw
    try:
        return TrainingSettings(**values)
    except InvalidInput as err:
        raise InvalidInput(str(err).replace("training: ", "training.", 1)) from None


def _deadlines(data: Any) -> Deadlines:
    if not isinstance(data, dict) or set(data) - {"op", "switch", "prepare"}:
        raise InvalidInput(
            f'deadlines={data!r} must be an object with "op", "switch" and "prepare" seconds'
        )
    values: dict[str, float] = {}
    for name, raw in data.items():
        if type(raw) not in (int, float):
            raise InvalidInput(f"deadlines.{name}={raw!r} must be a number of seconds")
        values[name] = float(raw)
    try:
        return Deadlines(**values)
    except InvalidInput as err:
        raise InvalidInput(f"deadlines: {err}") from None


def _budget(value: Any) -> int:
    if type(value) is not int or value < 1:
        raise InvalidInput(f"budget_bytes={value!r} must be a positive integer")
    return value
