"""What a member's loop reports (`loop.run_member`'s `report`): one typed value per event.

`Stepped` after every step the member trains, `Switched` for each change it settled (committed or
aborted, its own account) after `Decided` (the decision it acts on, said before the switch's last
collectives), `Undecided` for a switch whose decision it could not read, `Checkpointed` for each
checkpoint saved, `CheckpointFailed` for each one that could not be (the member trains on),
`Broke` when its world broke, `Finished` once when the job has trained its last step, and
`Refused` for a command it would not obey. The consumers
(the agent's server, the local launcher) branch on these types and turn them into their own
output at their own boundary; this module holds values only, it must not know how anyone prints
them. They pickle: the local launcher sends them between processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from liveshard_core.job import Cause, Result

from .recovery import Breakage
from .trainer import StepRecord


@dataclass(frozen=True)
class Stepped:
    """A step the member trained in world `epoch` (`layout`, described); `speaks`: the member is
    rank 0 of that world, the one that speaks for the job."""

    member: str
    epoch: int
    layout: str
    speaks: bool
    record: StepRecord
    pp_layers: tuple[int, ...] = ()  # the layers of each pipeline stage of that world


@dataclass(frozen=True)
class Switched:
    """One member's account of one reconfiguration; `report` marks the member that speaks for
    the job (rank 0 of the world the job trains in afterwards)."""

    epoch: int
    step: int
    from_layout: str
    to_layout: str
    result: Result
    cause: Cause | None  # None when committed
    reason: str
    pause_seconds: float  # the exposed pause: the last step before to the first step after (max)
    prepare_seconds: float  # request to prepared, on this member
    network_bytes: int
    report: bool
    lost: tuple[str, ...] = ()  # old members that died, for a recovery
    checksums: dict[str, str] = field(default_factory=dict)  # before/after digests, if asked
    switch_seconds: dict[str, float] = field(default_factory=dict)  # the engine's parts, here

    @property
    def committed(self) -> bool:
        return self.result is Result.COMMITTED


@dataclass(frozen=True)
class Decided:
    """The member acts on epoch `epoch`'s decision (`committed` or not) and is in the world it
    trains in next; its `Switched` account follows once the switch's last collectives end."""

    member: str
    epoch: int
    committed: bool


@dataclass(frozen=True)
class Undecided:
    """The member switched epoch `epoch` but could not read its decision (the change's store
    failed): it keeps its old state and its new one and waits to be told (`reason`: why)."""

    member: str
    epoch: int
    reason: str


@dataclass(frozen=True)
class Checkpointed:
    """Checkpoint `number` saved at `step` to `path`; `report` as for `Switched`. `export_to`:
    where it was asked to be exported (by the server, which fills in `export_error` if that
    failed)."""

    number: int
    step: int
    path: str
    seconds: float
    report: bool
    export_to: str = ""
    export_error: str = ""


@dataclass(frozen=True)
class CheckpointFailed:
    """Checkpoint `number` at `step` to `path` could not be saved, for `reason` (the same on
    every member of the world); nothing was put at `path` and the member trains on. `report` as
    for `Switched`."""

    number: int
    step: int
    path: str
    reason: str
    report: bool


@dataclass(frozen=True)
class Broke:
    """The member's world `epoch` broke under it; it keeps its state and waits for a recovery."""

    member: str
    epoch: int
    breakage: Breakage


@dataclass(frozen=True)
class Finished:
    """The job trained its last step (`step` is the next one, its number of steps)."""

    member: str
    step: int


@dataclass(frozen=True)
class Refused:
    """A command the member would not obey (bad input, out of order); it goes on as before."""

    command: str  # the command's type name
    message: str


Event = (
    Stepped
    | Switched
    | Decided
    | Undecided
    | Checkpointed
    | CheckpointFailed
    | Broke
    | Finished
    | Refused
)
Report = Callable[[Event], None]
