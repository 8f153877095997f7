"""An ElasticTrainingJob's spec as frozen values, checked beyond what the CRD's schema can say.

The API server has already refused what the schema and its CEL rules refuse (unknown fields,
replicas outside min/max, ...). What remains needs the model: that a fixed tp divides its heads,
that some layout fits at all. `JobSpec.parse` raises `InvalidInput` naming the field, the value
and what would be valid; the controller reports it as a condition, never as a crash.

What every agent of the job shares is one `liveshard_core.job.JobConfig`, built here from the CRD
once (`spec.training.<camelCase>` is the settings field of that name, and
`spec.parallelism.pipelineSchedule` the pipeline schedule's: `TrainingSettings.from_crd`;
`spec.rebalance` is `RebalanceSettings`, of which the agents read only the window they measure
over) and sent to the agents as its own JSON; the rest is the operator's: replicas, parallelism
constraints, checkpoints, the pod template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from liveshard_core.errors import InvalidInput
from liveshard_core.job import DEFAULT_BUDGET, DEFAULT_PORT, Deadlines, JobConfig, TrainingSettings
from liveshard_core.job.config import model_config
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import Degrees
from liveshard_core.vps.spec import ModelSpec

PENDING_TIMEOUT = 600  # spec.scheduling.pendingTimeoutSeconds's default
MAX_START_FAILURES = 5  # spec.scheduling.maxStartFailures's default
FAILED_PODS_KEPT = 3  # spec.faultTolerance.failedPodsHistoryLimit's default
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
# spec.reconfiguration's deadline fields, by the Deadlines field they set.
DEADLINE_FIELDS = {
    "op": "opTimeoutSeconds",
    "switch": "switchDeadlineSeconds",
    "prepare": "prepareDeadlineSeconds",
}


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
    """The job's spec, parsed. Its replica counts are of *members*: the spec's counts of pods
    times `members_per_pod` (a pod of several devices runs a member on each)."""

    replicas: int
    min_replicas: int
    max_replicas: int
    parallelism: Parallelism
    config: JobConfig  # its device is set: cpu or cuda
    checkpoint_path: str | None
    checkpoint_every: int
    export_to: str | None  # a Hugging Face directory the last step's checkpoint is written as
    restore_from: str
    port: int
    pending_timeout: float  # seconds a scheduled pod that is not ready may hold the job up
    gang: bool  # its pods are scheduled as a PodGroup of minReplicas
    suspend: bool  # save the state to a checkpoint and release every pod until it is false
    max_start_failures: int  # pods failed to start in a row before the job without a world fails
    template: dict[str, Any] = field(repr=False)
    snapshots: bool = True  # mirror ZeRO shards (`Layout.mirror`) wherever the layout can
    failed_pods_kept: int = FAILED_PODS_KEPT  # ended pods of past members kept for their logs
    members_per_pod: int = 1  # spec.membersPerPod, else the worker's nvidia.com/gpu, else 1

    @classmethod
    def parse(cls, spec: dict[str, Any]) -> JobSpec:
        par = spec.get("parallelism") or {}
        model = spec.get("model") or {}
        if sum(k in model for k in ("preset", "spec", "path")) != 1:
            raise InvalidInput("spec.model must give exactly one of preset, spec and path")
        reconf = spec.get("reconfiguration") or {}
        ckpt = spec.get("checkpoint") or {}
        template = spec.get("template") or {}
        scheduling = spec.get("scheduling") or {}
        faults = spec.get("faultTolerance") or {}
        snapshots = faults.get("snapshots", True)
        if type(snapshots) is not bool:
            raise InvalidInput(f"spec.faultTolerance.snapshots={snapshots!r} must be true or false")
        if ckpt.get("exportTo") and not ckpt.get("path"):
            raise InvalidInput(
                "spec.checkpoint.exportTo needs spec.checkpoint.path: the export is written from "
                "a checkpoint of the last step"
            )
        source = {k: model[k] for k in ("preset", "spec", "path", "init") if k in model}
        config = JobConfig(
            model=model_config(source, "spec.model"),
            model_path=model.get("path"),
            init=model.get("init"),
            precision=model.get("precision"),
            device=spec.get("device") or ("cuda" if _gpus(template) else "cpu"),
            training=TrainingSettings.from_crd(spec),
            deadlines=_deadlines(reconf),
            budget_bytes=parse_quantity(
                reconf.get("memoryBudget", DEFAULT_BUDGET), "spec.reconfiguration.memoryBudget"
            ),
            rebalance=RebalanceSettings.from_dict(
                spec.get("rebalance") or {}, "spec.rebalance", crd=True
            ),
        )
        per_pod = _members_per_pod(spec, template)
        job = cls(
            replicas=int(spec.get("replicas", 0)) * per_pod,
            min_replicas=int(spec.get("minReplicas", 1)) * per_pod,
            max_replicas=int(spec.get("maxReplicas", spec.get("replicas", 1))) * per_pod,
            members_per_pod=per_pod,
            parallelism=Parallelism(
                tp=par.get("tp"),
                pp=par.get("pp"),
                pp_max=par.get("ppMax"),
                ep=par.get("ep"),
                zero=int(par.get("zero", 1)),
            ),
            config=config,
            checkpoint_path=ckpt.get("path"),
            checkpoint_every=int(ckpt.get("everySteps", 0)),
            export_to=ckpt.get("exportTo"),
            restore_from=str(ckpt.get("restoreFrom") or ""),
            port=int(spec.get("port", DEFAULT_PORT)),
            pending_timeout=float(scheduling.get("pendingTimeoutSeconds", PENDING_TIMEOUT)),
            gang=bool(scheduling.get("gang", False)),
            suspend=bool(spec.get("suspend", False)),
            max_start_failures=_at_least(
                scheduling.get("maxStartFailures", MAX_START_FAILURES),
                "spec.scheduling.maxStartFailures",
                1,
            ),
            template=template,
            snapshots=snapshots,
            failed_pods_kept=_at_least(
                faults.get("failedPodsHistoryLimit", FAILED_PODS_KEPT),
                "spec.faultTolerance.failedPodsHistoryLimit",
                0,
            ),
        )
        if job.suspend and not job.checkpoint_path:
            raise InvalidInput(
                "spec.suspend needs spec.checkpoint.path: a suspended job keeps its state in a "
                "checkpoint there"
            )
        job._check_fixed_degrees()
        return job

    @property
    def device(self) -> str:
        return self.config.device or "cpu"

    @property
    def training(self) -> TrainingSettings:
        return self.config.training

    @property
    def deadlines(self) -> Deadlines:
        return self.config.deadlines

    @property
    def budget_bytes(self) -> int:
        return self.config.budget_bytes

    @property
    def rebalance(self) -> RebalanceSettings:
        return self.config.rebalance

    def memory_limit(self) -> int | None:
        """The agent container's memory limit in the pod template, in bytes (None: none, or one
        written in a form `parse_quantity` does not read)."""
        containers = (self.template.get("spec") or {}).get("containers") or [{}]
        limit = ((containers[0].get("resources") or {}).get("limits") or {}).get("memory")
        try:
            return None if limit is None else parse_quantity(limit, "memory limit")
        except InvalidInput:
            return None

    def _check_fixed_degrees(self) -> None:
        """A fixed tp, pp or ep the model cannot take is reported now, not at a switch."""
        model = self.model_spec()
        p = self.parallelism
        tp, pp, ep = p.tp or 1, p.pp or 1, p.ep or 1
        try:
            Degrees(dp=ep, tp=tp, pp=pp, ep=ep, zero=p.zero).layout(
                model, [str(i) for i in range(ep * tp * pp)]
            )
        except InvalidInput as err:
            raise InvalidInput(f"spec.parallelism: {err}") from None
        per_pod = self.members_per_pod
        if per_pod > 1 and p.tp is not None and per_pod % p.tp:
            raise InvalidInput(
                f"spec.parallelism.tp={p.tp} must divide the {per_pod} members of a pod: a "
                "tensor-parallel group stays inside one"
            )

    def pods(self, members: int) -> int:
        """The pods that hold `members` members."""
        return -(-members // self.members_per_pod)

    def model_spec(self) -> ModelSpec:
        """The model as the agents build it."""
        return self.config.model_spec(self.device)

    def agent_config(self) -> str:
        """LIVESHARD_CONFIG of the agents: what they train and how they switch."""
        return self.config.to_json()

    def constraints(self) -> Degrees:
        """The fixed degrees (1 where free), for messages."""
        p = self.parallelism
        return Degrees(tp=p.tp or 1, pp=p.pp or 1, ep=p.ep or 1, zero=p.zero)


def _deadlines(reconf: dict[str, Any]) -> Deadlines:
    values = {name: reconf[key] for name, key in DEADLINE_FIELDS.items() if key in reconf}
    try:
        return Deadlines.from_dict(values)
    except InvalidInput as err:
        raise InvalidInput(f"spec.reconfiguration: {err}") from None


def _at_least(value: Any, field_name: str, least: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return value
    raise InvalidInput(f"{field_name}={value!r} must be an integer >= {least}")


def _gpus(template: dict[str, Any]) -> int:
    """The `nvidia.com/gpu` the worker container (the first) asks for: its limit, else its
    request (0: none)."""
    containers = (template.get("spec") or {}).get("containers") or [{}]
    resources = containers[0].get("resources") or {}
    for kind in ("limits", "requests"):
        count = (resources.get(kind) or {}).get("nvidia.com/gpu")
        if count is not None:
            try:
                return int(str(count))
            except ValueError:
                raise InvalidInput(
                    f"spec.template: nvidia.com/gpu={count!r} must be a whole number"
                ) from None
    return 0


def _members_per_pod(spec: dict[str, Any], template: dict[str, Any]) -> int:
    """spec.membersPerPod, else one member per GPU of the worker container, else 1."""
    gpus = _gpus(template)
    if "membersPerPod" not in spec:
        return max(gpus, 1)
    count = _at_least(spec["membersPerPod"], "spec.membersPerPod", 1)
    if gpus and count != gpus:
        raise InvalidInput(
            f"spec.membersPerPod={count} must equal the worker container's nvidia.com/gpu="
            f"{gpus}: a member per device"
        )
    return count
