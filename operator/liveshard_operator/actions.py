"""What a reconcile pass asks of the world, as values: the decision (`decide`) returns them, the
executor (`act`) carries them out, and nothing else touches a pod or an agent.

Actions are done whatever their outcome (a failed agent call is logged: the next pass sees what
happened). The two *asks* are different: what the pass writes depends on their answer, so the
executor puts the answer back into the decision (`decide.hosted`, `decide.not_hosted`,
`decide.checkpointed`) before it writes the status.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from liveshard_core.job import Deadlines
from liveshard_core.layout.layout import Layout

from .world import InFlight


class EventType(Enum):
    """A Kubernetes Event's type."""

    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True)
class CreatePod:
    """Create a worker pod (rendered by `render.worker_pod`: it starts standing by)."""

    pod: dict[str, Any]


@dataclass(frozen=True)
class DeletePod:
    pod: str
    because: str = ""  # logged as a warning when set: the pod is deleted for what it did


@dataclass(frozen=True)
class ReleaseMember:
    """Tell a pod's agent that the job needs it no more (its process may end); `saved`: even as
    a member of the world in effect, its state being saved as that checkpoint (a suspension)."""

    member: str
    saved: int = 0


@dataclass(frozen=True)
class LabelPod:
    pod: str
    role: str  # render.MEMBER or render.STANDBY


@dataclass(frozen=True)
class Prepare:
    """Ask `member` to prepare the reconfiguration to `to` (from `old`; None: a first world)."""

    member: str
    epoch: int
    store: tuple[str, int]
    to: Layout
    old: Layout | None
    lost: tuple[str, ...]
    budget: int
    deadlines: Deadlines
    restore_from: str
    pods: tuple[tuple[str, str], ...] = ()  # (member, pod) of members that share a pod


@dataclass(frozen=True)
class AbortOn:
    """Ask `member` to drop `epoch`, pending there."""

    member: str
    epoch: int


@dataclass(frozen=True)
class CommitOn:
    """Tell `member`, undecided in `epoch` (its store died before it read the decision), that the
    epoch committed: another member trains in it."""

    member: str
    epoch: int


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the job."""

    type: EventType
    reason: str
    message: str


Action = CreatePod | DeletePod | ReleaseMember | LabelPod | Prepare | AbortOn | CommitOn | Event


@dataclass(frozen=True)
class Begin:
    """Ask `host` to host the store of `plan`'s epoch, then begin `plan` (its store's address is
    the answer): record it in flight, then send Prepare."""

    host: str
    plan: InFlight
    restores: bool = False  # it is the restore from a checkpoint the record owes


@dataclass(frozen=True)
class Checkpoint:
    """Ask every member, in rank order, to save checkpoint `number` at `path` once it reaches
    `at_step`; the answer is whether every one took the request."""

    members: tuple[str, ...]
    number: int
    path: str
    at_step: int
    export_to: str = ""  # then the member of rank 0 exports it there once saved


Ask = Begin | Checkpoint
