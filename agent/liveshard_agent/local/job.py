"""A local job: what `liveshard-local` runs, as one value the driver and every member's process
share (it goes to each process when it is spawned, so everything in it pickles).

It holds the job's configuration (`liveshard_core.job.JobConfig`), the members at the start, the
scripted switches (`--switch STEP:LAYOUT`) and kills (`--kill STEP:RANK`, `faults`), what to
save or report, and the job's secret: drawn for each job, it reaches the members with the job and
seals what they act on in the job's store (`engine.sealed`), as the job's token does on
Kubernetes; no repr shows it. `LocalJob.check` refuses, before any process starts, what no member
could run. This module describes a job; it must not start or drive one.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from liveshard_core.errors import InvalidInput
from liveshard_core.job import DEFAULT_BUDGET, Deadlines, JobConfig, TrainingSettings
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import Degrees, parse_degrees
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import ModelSpec

from ..engine.sealed import Seal
from ..engine.switch import SwitchHooks
from .faults import SWITCH_PHASES, ScriptedKill

LOCAL_DEADLINES = Deadlines(op=60.0, switch=120.0, prepare=300.0)
JOB_NAME = "local"  # every local job's name, in its log lines and its seal

HooksFactory = Callable[[str], SwitchHooks]  # a member's name to its switch hooks


@dataclass(frozen=True)
class ScriptedSwitch:
    """Switch to `degrees` at `step`; `members` names the new layout's members in rank order
    (by default the current members in order, then standing-by ones, then new ones)."""

    step: int
    degrees: Degrees
    text: str
    members: tuple[str, ...] | None = None


def parse_switch(text: str) -> ScriptedSwitch:
    """`STEP:LAYOUT`, e.g. `20:tp=2,dp=2`."""
    step, sep, layout = text.partition(":")
    if not sep or not step.strip().isdigit():
        raise InvalidInput(f"--switch {text!r}: expected STEP:LAYOUT, e.g. 20:tp=2,dp=2")
    return ScriptedSwitch(int(step), parse_degrees(layout), layout)


def local_config(
    model: str,
    settings: TrainingSettings,
    *,
    device: str = "cpu",
    precision: str | None = None,
    budget: int = DEFAULT_BUDGET,
    init: str | None = None,
    rebalance: RebalanceSettings | None = None,
) -> JobConfig:
    """A local job's configuration: `model` a Hugging Face model directory, a preset name or a
    JSON/YAML model file."""
    directory = model if Path(model).is_dir() else None
    return JobConfig(
        model=resolve_model(model).config, precision=precision, device=device,
        training=settings, deadlines=LOCAL_DEADLINES, budget_bytes=budget,
        model_path=directory, init=init, rebalance=rebalance or RebalanceSettings(),
    )  # fmt: skip


@dataclass(frozen=True)
class LocalJob:
    config: JobConfig  # its device is set: cpu or cuda
    nprocs: int
    layout: Degrees
    switches: tuple[ScriptedSwitch, ...]
    checksums: bool = False  # compare whole-state checksums around every switch (slower)
    checkpoint_dir: str | None = None  # save a checkpoint to DIR/step-N every checkpoint_every
    checkpoint_every: int = 0
    resume: str | None = None  # start from this checkpoint (written in any layout)
    record_samples: bool = False  # report the samples each replica fed in, every step
    # Each member's SwitchHooks, made in its process from its name: how tests inject faults.
    # The job goes to every member's process, so it must pickle (a module-level function, or a
    # functools.partial of one).
    hooks: HooksFactory | None = None
    kills: tuple[ScriptedKill, ...] = ()  # --kill: see `faults`
    secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False, compare=False)

    def seal(self) -> Seal:
        """The seal of the job's values in its store, the same in the driver and every member."""
        return Seal.of(self.secret, JOB_NAME)

    @property
    def settings(self) -> TrainingSettings:
        return self.config.training

    @property
    def device(self) -> str:
        return self.config.device or "cpu"

    @property
    def deadlines(self) -> Deadlines:
        return self.config.deadlines

    @property
    def budget(self) -> int:
        return self.config.budget_bytes

    def spec(self) -> ModelSpec:
        return self.config.model_spec(self.device)

    def check(self) -> None:
        """Reject, before any process starts, a layout the model or the global batch cannot use."""
        spec = self.spec()
        if self.checkpoint_every and not self.checkpoint_dir:
            raise InvalidInput("--checkpoint-every needs --checkpoint-dir")
        if self.layout.world_size != self.nprocs:
            raise InvalidInput(
                f"--layout {self.layout.describe()} has {self.layout.world_size} ranks (ep "
                f"divides dp), not --nprocs {self.nprocs}"
            )
        steps = self.settings.steps
        late = [f"--switch {s.step}:{s.text}" for s in self.switches if s.step >= steps] + [
            f"--{k.action} {k.step}:{k.rank}:{k.phase}" for k in self.kills if k.step >= steps
        ]
        if late:
            raise InvalidInput(
                f"{', '.join(late)}: the job trains steps 0 to {steps - 1} (--steps {steps}), "
                "so this would never happen"
            )
        self._check_order()
        self._check_kills()
        for label, degrees in [("--layout", self.layout)] + [
            (f"--switch {s.step}:{s.text}", s.degrees) for s in self.switches
        ]:
            try:
                degrees.layout(spec, [str(i) for i in range(degrees.world_size)])
                self.settings.micro_batches(degrees.dp)
            except InvalidInput as err:
                raise InvalidInput(f"{label}: {err}") from None
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise InvalidInput("--device cuda: no CUDA device is available")
            most = max([self.nprocs] + [s.degrees.world_size for s in self.switches])
            if most > torch.cuda.device_count():
                raise InvalidInput(
                    f"--device cuda: {most} members need {most} GPUs (NCCL wants one per "
                    f"rank); {torch.cuda.device_count()} available"
                )

    def _check_order(self) -> None:
        """Scripted switches come in step order, one per step (`job_from_args` sorts the flags)."""
        for before, after in itertools.pairwise(self.switches):
            if after.step <= before.step:
                raise InvalidInput(
                    f"--switch {before.step}:{before.text}, --switch {after.step}:{after.text}: "
                    "one switch per step, in step order"
                )

    def _check_kills(self) -> None:
        """Each kill names a rank of the layout it happens in: a phase of a switch, one scripted
        at its step (its rank one of the layout the switch leaves); a step or an update, the
        layout scripted for that step."""
        for kill in self.kills:
            label = f"--{kill.action} {kill.step}:{kill.rank}:{kill.phase}"
            before = [s for s in self.switches if s.step < kill.step]
            at = [s for s in self.switches if s.step == kill.step]
            if kill.phase in SWITCH_PHASES and not at:
                raise InvalidInput(
                    f"{label}: no switch is scripted at step {kill.step} (--switch "
                    f"{kill.step}:LAYOUT) for it to happen in"
                )
            scripted = before if kill.phase in SWITCH_PHASES else before + at
            layout = scripted[-1].degrees if scripted else self.layout
            if kill.rank >= layout.world_size:
                raise InvalidInput(
                    f"{label}: the layout it happens in, {layout.describe()}, has ranks 0 to "
                    f"{layout.world_size - 1}"
                )
