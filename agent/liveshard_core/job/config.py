"""`JobConfig`: what every member of a job shares, and the one rule that makes its model spec.

The operator builds it from the CRD, the local launcher from its flags, and the agent parses it
from the JSON the operator sends (`to_json` / `from_json`, the LIVESHARD_CONFIG variable): one
value, written once, so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import InvalidInput
from ..vps.hf import HfModel
from ..vps.presets import CONFIGS, resolve_model
from ..vps.spec import DType, ModelSpec, TransformerConfig, config_from_dict, config_to_dict
from .deadlines import Deadlines
from .rebalance import RebalanceSettings
from .settings import TrainingSettings

DEFAULT_PORT = 7070  # the agent API's
DEFAULT_METRICS_PORT = 9400  # the agent's Prometheus metrics
MEMBER_KEY = "liveshard-member"  # the gRPC metadata key naming the member a call is for
DEFAULT_BUDGET = 256 << 20  # transfer buffer bytes per member per round
PRECISIONS = ("fp32", "bf16")
INITS = ("pretrained", "random")
DEVICES = ("cpu", "cuda")
_KEYS = ("model", "precision", "device", "training", "deadlines", "budget_bytes", "rebalance")


@dataclass(frozen=True)
class JobConfig:
    """The same on every member of a job."""

    model: TransformerConfig
    precision: str | None = None  # None: fp32 on CPU, the model's own on GPUs
    device: str | None = None  # None: cuda when a GPU is visible, else cpu
    training: TrainingSettings = field(default_factory=TrainingSettings)
    deadlines: Deadlines = field(default_factory=Deadlines)
    budget_bytes: int = DEFAULT_BUDGET
    model_path: str | None = None  # a Hugging Face model directory `model` was read from
    init: str | None = None  # None: from the directory's weights when it has them, else random
    rebalance: RebalanceSettings = field(default_factory=RebalanceSettings)

    def __post_init__(self) -> None:
        _choice(self.precision, "precision", PRECISIONS)
        _choice(self.device, "device", DEVICES)
        _choice(self.init, "model.init", INITS)
        if type(self.budget_bytes) is not int or self.budget_bytes < 1:
            raise InvalidInput(f"budget_bytes={self.budget_bytes!r} must be a positive integer")
        if self.init == "pretrained" and self.model_path is None:
            raise InvalidInput("model.init=pretrained needs a model directory (model.path)")
        window, seq = self.model.sliding_window, self.training.seq_len
        if window and seq > window:
            raise InvalidInput(
                f"training.seq_len={seq} exceeds the model's sliding_window={window}: sliding-"
                "window attention is not computed, so sequences must fit in the window"
            )
        for i, (_, layers) in enumerate(self.training.freeze):
            if layers > self.model.layers:
                raise InvalidInput(
                    f"training.freeze[{i}].layers={layers} exceeds the model's "
                    f"{self.model.layers} layers"
                )

    @cached_property
    def hf_model(self) -> HfModel | None:
        """The Hugging Face directory the model comes from, if any (read once)."""
        return HfModel.load(self.model_path) if self.model_path else None

    @property
    def pretrained(self) -> bool:
        """Whether a first world starts from the directory's weights (else a fresh
        initialisation)."""
        model = self.hf_model
        return model is not None and (
            self.init == "pretrained" or (self.init is None and model.has_weights)
        )

    def model_spec(self, device_type: str) -> ModelSpec:
        """The model as every member builds it on `device_type`: fp32 parameters without a
        master copy on CPU unless a precision is given (comparable across layouts), the model's
        own dtype (bf16 with an fp32 master) on GPUs."""
        precision = self.precision or ("fp32" if device_type == "cpu" else None)
        config = self.model
        if precision is not None and config.param_dtype is not DType(precision):
            config = dataclasses.replace(config, param_dtype=DType(precision))
        return ModelSpec.from_config(config)

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self._model_source(),
                "precision": self.precision,
                "device": self.device,
                "training": self.training.as_dict(),
                "deadlines": self.deadlines.as_dict(),
                "budget_bytes": self.budget_bytes,
                "rebalance": self.rebalance.as_dict(),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        """`{"model": {"preset": NAME} | {"spec": {TransformerConfig fields}}, "precision": null |
        "fp32" | "bf16", "device": null | "cpu" | "cuda", "training": {TrainingSettings fields},
        "deadlines": {"op": s, "switch": s, "prepare": s}, "budget_bytes": n, "rebalance":
        {RebalanceSettings fields}}`; only `model` is
        required. Errors name the field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidInput(f"not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise InvalidInput(f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise InvalidInput(f"unknown field(s) {unknown}; valid fields: {list(_KEYS)}")
        if "model" not in data:
            raise InvalidInput('model: required, e.g. {"preset": "tiny"}')
        budget = data.get("budget_bytes", DEFAULT_BUDGET)
        if type(budget) is not int:
            raise InvalidInput(f"budget_bytes={budget!r} must be a positive integer")
        source = data["model"]
        path = source.get("path") if isinstance(source, dict) else None
        return cls(
            model=model_config(source, "model"),
            model_path=path,
            init=source.get("init") if path else None,
            precision=data.get("precision"),
            device=data.get("device"),
            training=TrainingSettings.from_dict(data.get("training") or {}),
            deadlines=Deadlines.from_dict(data.get("deadlines") or {}),
            budget_bytes=budget,
            rebalance=RebalanceSettings.from_dict(data.get("rebalance") or {}),
        )

    def _model_source(self) -> dict[str, Any]:
        """A directory by its path, a preset by its name (readable in a pod's environment), any
        other model by its fields."""
        if self.model_path is not None:
            return {"path": self.model_path} | ({"init": self.init} if self.init else {})
        if CONFIGS.get(self.model.name) == self.model:
            return {"preset": self.model.name}
        return {"spec": config_to_dict(self.model)}


def model_config(data: Any, where: str) -> TransformerConfig:
    """`{"preset": NAME}` (a preset or a JSON/YAML file), `{"spec": {model fields}}` or
    `{"path": DIR[, "init": "pretrained" | "random"]}` (a Hugging Face model directory)."""
    if isinstance(data, dict) and "path" in data and set(data) <= {"path", "init"}:
        if not isinstance(data["path"], str) or not data["path"]:
            raise InvalidInput(f"{where}.path={data['path']!r} must be a directory")
        try:
            return HfModel.load(data["path"]).config
        except InvalidInput as err:
            raise InvalidInput(f"{where}.path: {err}") from None
    if not isinstance(data, dict) or len(data) != 1 or not {"preset", "spec"} >= set(data):
        raise InvalidInput(
            f'{where}={data!r} must be {{"preset": NAME}}, {{"spec": {{model fields}}}} or '
            f'{{"path": DIR}}'
        )
    if "preset" in data:
        if not isinstance(data["preset"], str):
            raise InvalidInput(f"{where}.preset={data['preset']!r} must be a string")
        try:
            return resolve_model(data["preset"]).config
        except InvalidInput as err:
            raise InvalidInput(f"{where}.preset: {err}") from None
    return config_from_dict(data["spec"], f"{where}.spec")


def _choice(value: Any, name: str, valid: tuple[str, ...]) -> None:
    if value is not None and value not in valid:
        raise InvalidInput(f"{name}={value!r} must be null or one of {list(valid)}")
