"""Requests checked field by field, as values the runtime takes.

Every check here depends on the request and the job alone (the model, the training settings,
this agent's name), never on the agent's state: a failure raises `InvalidInput` naming the field,
the value and what would be valid (INVALID_ARGUMENT). What the agent's state allows is the
service's business. This module must not enqueue anything.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput
from liveshard_core.job import Deadlines, TrainingSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.vps.spec import ModelSpec

from ..engine.world import StoreAddress
from ..runtime import checkpoint
from ..runtime.change import Change
from ..runtime.loop import Prepare, Start

_NAME_MAX = 253  # a Kubernetes object name's limit


@dataclass(frozen=True)
class Job:
    """What every request is checked against: the agent's name and the job it trains."""

    member: str
    spec: ModelSpec
    settings: TrainingSettings
    deadlines: Deadlines  # the agent's own, for a request's zero fields
    budget_bytes: int


@dataclass(frozen=True)
class PrepareOrder:
    """A checked Prepare: the runtime command, the deadlines it runs under, and its layouts."""

    epoch: int
    command: Start | Prepare
    old: Layout | None  # None: the job's first world
    new: Layout
    deadlines: Deadlines
    at_step: int


def layout(message: pb.Layout, job: Job, name: str) -> Layout:
    """A layout of `job`'s model that its global batch can fill; errors name `name`."""
    members = list(message.members)
    _member_names(members, name)
    try:
        result = Layout.create(
            job.spec, members, dp=message.dp, tp=message.tp, pp=message.pp,
            ep=message.ep, zero=message.zero, pp_layers=tuple(message.pp_layers) or None,
            mirror=message.mirror,
        )  # fmt: skip
    except InvalidInput as err:
        raise InvalidInput(f"{name}: {str(err).removeprefix('layout: ')}") from None
    try:
        job.settings.micro_batches(result.dp)
    except InvalidInput as err:
        raise InvalidInput(f"{name}.dp: {err}") from None
    return result


def _member_names(members: list[str], name: str) -> None:
    """InvalidInput naming the first of `members` that is no member's name. All are checked at
    once first: every agent checks the two layouts of each Prepare, 2048 names at 1024 members."""
    joined = "".join(members)
    lengths = list(map(len, members))
    if not members or (
        min(lengths) >= 1 and max(lengths) <= _NAME_MAX and joined.isprintable()
        and " " not in joined
    ):  # fmt: skip
        return
    for i, member in enumerate(members):
        if not member or len(member) > _NAME_MAX or not member.isprintable() or " " in member:
            raise InvalidInput(
                f"{name}.members[{i}]={member!r} must be a member name (a pod's name: "
                f"1 to {_NAME_MAX} printable characters, no spaces)"
            )


def store_address(message: pb.StoreAddress, present: bool) -> StoreAddress:
    if not present:
        raise InvalidInput("store: required (the address HostStore returned for this epoch)")
    if not message.host or len(message.host) > _NAME_MAX or not message.host.isprintable():
        raise InvalidInput(f"store.host={message.host!r} must be a host name or IP address")
    if not 1 <= message.port <= 65535:
        raise InvalidInput(f"store.port={message.port} must be in 1..65535")
    return StoreAddress(message.host, message.port)


MAX_DEADLINE = 6 * 3600.0  # seconds: no request holds a member longer than this


def deadlines(message: pb.Deadlines, defaults: Deadlines) -> Deadlines:
    """A request's deadlines, each at most MAX_DEADLINE; a zero field takes the agent's
    configured one."""
    values: dict[str, float] = {}
    for name in ("op", "switch", "prepare"):
        got = getattr(message, f"{name}_seconds")
        if not math.isfinite(got) or not 0 <= got <= MAX_DEADLINE:
            raise InvalidInput(
                f"deadlines.{name}_seconds={got} must be in [0, {MAX_DEADLINE:.0f}] seconds (0: "
                f"the agent's {getattr(defaults, name)} s)"
            )
        values[name] = float(got or getattr(defaults, name))
    try:
        return Deadlines(**values)
    except InvalidInput as err:
        raise InvalidInput(
            f"deadlines: {err} (after zero fields took the agent's {defaults})"
        ) from None


def epoch(value: int) -> int:
    if value < 0:
        raise InvalidInput(f"epoch={value} must be >= 0 (the job's first world is epoch 0)")
    return value


def at_step(value: int, name: str = "at_step") -> int:
    if value < 0:
        raise InvalidInput(f"{name}={value} must be >= 0 (0: the first boundary possible)")
    return value


def prepare(request: pb.PrepareRequest, job: Job) -> PrepareOrder:
    """A Prepare's command: `Start` for the job's first world (no `from`), else a `Prepare` of a
    change from the layout in `from`."""
    number = epoch(request.epoch)
    if not request.HasField("to"):
        raise InvalidInput("to: required (the layout to prepare, with its members)")
    new = layout(request.to, job, "to")
    store = store_address(request.store, request.HasField("store"))
    limits = deadlines(request.deadlines, job.deadlines)
    if request.budget_bytes < 0:
        raise InvalidInput(f"budget_bytes={request.budget_bytes} must be >= 0 (0: the default)")
    if request.at_step < -1:
        raise InvalidInput(f"at_step={request.at_step} must be >= -1 (-1: hold until Switch)")
    if not request.HasField("from"):
        return _first_world(request, job, number, new, store, limits)
    if request.restore_from:
        raise InvalidInput("restore_from: only the job's first world (no `from`) restores")
    old = layout(getattr(request, "from"), job, "from")
    if job.member not in old.ranks and job.member not in new.ranks:
        raise InvalidInput(
            f"to.members: this agent, {job.member!r}, is a member of neither `from` nor `to`"
        )
    lost = list(request.lost)
    for i, name in enumerate(lost):
        if name not in old.ranks or name in new.ranks or name == job.member:
            raise InvalidInput(
                f"lost[{i}]={name!r} must be a member of `from` that is not in `to` and is not "
                f"this agent"
            )
    if len(set(lost)) != len(lost):
        raise InvalidInput(f"lost={lost} names a member twice")
    pods = dict(request.pods)
    strangers = pods.keys() - old.ranks.keys() - new.ranks.keys()
    for name in sorted(strangers | {name for name, pod in pods.items() if not pod}):
        if name in strangers:
            raise InvalidInput(f"pods[{name!r}]: {name!r} is a member of neither `from` nor `to`")
        raise InvalidInput(f"pods[{name!r}] is empty: name the member's pod, or leave it out")
    change = Change(
        epoch=number, old=old, new=new, at_step=request.at_step, lost=frozenset(lost),
        budget=request.budget_bytes or job.budget_bytes, pods=pods,
    )  # fmt: skip
    return PrepareOrder(number, Prepare(change, store), old, new, limits, request.at_step)


def _first_world(
    request: pb.PrepareRequest,
    job: Job,
    number: int,
    new: Layout,
    store: StoreAddress,
    limits: Deadlines,
) -> PrepareOrder:
    if job.member not in new.ranks:
        raise InvalidInput(f"to.members: this agent, {job.member!r}, is not a member of `to`")
    if request.lost:
        raise InvalidInput("lost: only a reconfiguration (with `from`) has lost members")
    if request.at_step not in (0, -1):
        raise InvalidInput(
            f"at_step={request.at_step}: a first world starts as soon as its members are in; "
            "give 0 (or -1)"
        )
    restore = request.restore_from or None
    if restore is not None:
        if not os.path.isabs(restore):
            raise InvalidInput(f"restore_from={restore!r} must be an absolute path")
        try:  # a directory that is no whole checkpoint of this model is refused here, by name
            checkpoint.read_metadata(restore, job.spec)
        except InvalidInput as err:
            raise InvalidInput(f"restore_from: {err}") from None
    return PrepareOrder(number, Start(new, store, number, restore), None, new, limits, 0)


def checkpoint_path(path: str) -> str:
    if not path or not os.path.isabs(path):
        raise InvalidInput(
            f"path={path!r} must be an absolute path of a directory every member can write"
        )
    return path


def export_path(path: str) -> str:
    """A checkpoint's `export_to`: empty (none), or an absolute path."""
    if path and not os.path.isabs(path):
        raise InvalidInput(f"export_to={path!r} must be empty or an absolute path")
    return path
