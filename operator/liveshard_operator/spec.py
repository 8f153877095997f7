"""An ElasticTrainingJob's spec as frozen values, checked beyond what the CRD's schema can say.

The API server has already refused what the schema and its CEL rules refuse (unknown fields,
replicas outside min/max, ...). What remains needs the model: that a fixed tp divides its heads,
that some layout fits at all. `JobSpec.parse` raises `InvalidInput` naming the field, the value
and what would be valid; the controller reports it as a condition, never as a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Degrees
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, config_from_dict, config_to_dict

DEFAULT_PORT = 7070
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def parse_quantity(value: Any, field_name: str) -> int:
    """A byte count: an integer, or a Kubernetes quantity like `256Mi` or `2G`."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        for suffix, factor in _UNITS.items():
            if value.endswith(suffix) and value[: -len(suffix)].isdigit():
                return int(value[: -len(suffix)]) * factor
        if value.isdigit() and int(value) > 0:
            return int(value)
    raise InvalidInput(
        f"{field_name}={value!r} must be a positive byte count like 268435456 or 256Mi"
    )


@dataclass(frozen=True)
class Parallelism:
    """Constraints on the layouts the policy may choose: None means free."""

    tp: int | None = None
    pp: int | None = None
    pp_max: int | None = None
    ep: int | None = None
    zero: int = 1


@dataclass(frozen=True)
class JobSpec:
    replicas: int
    min_replicas: int
    max_replicas: int
    parallelism: Parallelism
    model: dict[str, Any]  # {"preset": name} or {"spec": fields}
    precision: str | None
    device: str
    training: dict[str, Any]  # TrainingSettings fields, snake_case
    budget_bytes: int
    deadlines: dict[str, float]  # op, switch, prepare
    checkpoint_path: str | None
    checkpoint_every: int
    restore_from: str
    port: int
    template: dict[str, Any] = field(repr=False)

    @classmethod
    def parse(cls, spec: dict[str, Any]) -> JobSpec:
        par = spec.get("parallelism") or {}
        model = spec.get("model") or {}
        if ("preset" in model) == ("spec" in model):
            raise InvalidInput("spec.model must give exactly one of preset and spec")
        training = spec.get("training") or {}
        reconf = spec.get("reconfiguration") or {}
        ckpt = spec.get("checkpoint") or {}
        template = spec.get("template") or {}
        job = cls(
            replicas=int(spec.get("replicas", 0)),
            min_replicas=int(spec.get("minReplicas", 1)),
            max_replicas=int(spec.get("maxReplicas", spec.get("replicas", 1))),
            parallelism=Parallelism(
                tp=par.get("tp"),
                pp=par.get("pp"),
                pp_max=par.get("ppMax"),
                ep=par.get("ep"),
                zero=int(par.get("zero", 1)),
            ),
            model={"preset": model["preset"]} if "preset" in model else {"spec": model["spec"]},
            precision=model.get("precision"),
            device=spec.get("device") or ("cuda" if _requests_gpus(template) else "cpu"),
            training={
                "global_batch": int(training.get("globalBatch", 24)),
                "micro_batch": int(training.get("microBatch", 1)),
                "seq_len": int(training.get("seqLen", 64)),
                "steps": int(training.get("steps", 1000)),
                "seed": int(training.get("seed", 0)),
                "lr": float(training.get("lr", 3e-3)),
                "min_lr": float(training.get("lr", 3e-3)) / 10,
                "dropout": float(training.get("dropout", 0.0)),
                "data": training.get("data"),
            },
            budget_bytes=parse_quantity(
                reconf.get("memoryBudget", "256Mi"), "spec.reconfiguration.memoryBudget"
            ),
            deadlines={
                "op": float(reconf.get("opTimeoutSeconds", 30)),
                "switch": float(reconf.get("switchDeadlineSeconds", 120)),
                "prepare": float(reconf.get("prepareDeadlineSeconds", 300)),
            },
            checkpoint_path=ckpt.get("path"),
            checkpoint_every=int(ckpt.get("everySteps", 0)),
            restore_from=str(ckpt.get("restoreFrom") or ""),
            port=int(spec.get("port", DEFAULT_PORT)),
            template=template,
        )
        job._check_fixed_degrees()
        return job

    def _check_fixed_degrees(self) -> None:
        """A fixed tp, pp or ep the model cannot take is reported now, not at a switch."""
        model = self.model_spec()  # a model that cannot be built too
        p = self.parallelism
        tp, pp, ep = p.tp or 1, p.pp or 1, p.ep or 1
        try:
            Degrees(dp=ep, tp=tp, pp=pp, ep=ep, zero=p.zero).layout(
                model, [str(i) for i in range(ep * tp * pp)]
            )
        except InvalidInput as err:
            raise InvalidInput(f"spec.parallelism: {err}") from None

    def model_spec(self) -> ModelSpec:
        """The model as the agents build it (fp32 without a master copy on CPU by default)."""
        if "preset" in self.model:
            config = preset(self.model["preset"]).config
        else:
            config = config_from_dict(self.model["spec"], "spec.model.spec")
        precision = self.precision or ("fp32" if self.device == "cpu" else None)
        data = config_to_dict(config)
        if precision is not None:
            data["param_dtype"] = precision
        return ModelSpec.from_config(config_from_dict(data, "spec.model"))

    def agent_config(self) -> str:
        """LIVESHARD_CONFIG of the agents: what they train and how they switch."""
        return json.dumps(
            {
                "model": self.model,
                "precision": self.precision,
                "device": self.device,
                "training": self.training,
                "deadlines": self.deadlines,
                "budget_bytes": self.budget_bytes,
            },
            sort_keys=True,
        )

    def constraints(self) -> Degrees:
        """The fixed degrees (1 where free), for messages."""
        p = self.parallelism
        return Degrees(tp=p.tp or 1, pp=p.pp or 1, ep=p.ep or 1, zero=p.zero)


def _requests_gpus(template: dict[str, Any]) -> bool:
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            if "nvidia.com/gpu" in (resources.get(kind) or {}):
                return True
    return False
