"""A member's loop: train while in a world, switch and checkpoint when agreed, obey commands.

A member that switched but could not read the decision (`MemberState.UNDECIDED`: the change's
store failed) takes commands only: a `SwitchAt` of its epoch commits it, a `Drop` aborts it.

When a step or what follows it at the boundary fails in a collective (torch raises RuntimeError:
a peer died or timed out), the world is broken: the loop reports `Broke` and the member waits,
state kept, for a recovery (see `Member.break_world`).

The same loop runs under the local launcher (commands from the driver over a pipe) and in the
agent's server (commands from gRPC calls): both feed an `Inbox` and take the `report`ed events
(`events`: typed values, never strings to parse). A command that is refused (bad input, out of
order) is reported as `Refused`, naming it, and the member goes on as before. A checkpoint that
cannot be saved is reported as `CheckpointFailed` by every member of the world alike, and they
train on: a checkpoint is never a reason to stop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from torch.distributed import Store, TCPStore

from liveshard_core.errors import LiveshardError
from liveshard_core.job import Cause
from liveshard_core.layout.layout import Layout

from ..engine.world import StoreAddress
from .change import Change
from .events import Broke, Finished, Refused, Report, Stepped, Switched
from .member import Member, MemberState
from .trainer import StepRecord

_JOIN_POLL = 0.01  # seconds between looks for a switch's announcement while joining
# Seconds a training member waits, at the boundary it takes a Prepare, for the connect to the
# change's store to end: milliseconds where the store is served and names resolve at once, and
# then the member prepares at once rather than a step later. A slower connect is held meanwhile.
_CONNECT_GRACE = 0.1


@dataclass(frozen=True)
class Start:
    """Join the job's first world (from a checkpoint when `restore` names one)."""

    layout: Layout
    store: StoreAddress
    epoch: int = 0
    restore: str | None = None


@dataclass(frozen=True)
class Prepare:
    """Prepare a change; its members meet in the store at `store`."""

    change: Change
    store: StoreAddress


@dataclass(frozen=True)
class SwitchAt:
    epoch: int
    at_step: int


@dataclass(frozen=True)
class Drop:
    epoch: int
    reason: str = "dropped on request"


@dataclass(frozen=True)
class CheckpointAt:
    number: int
    path: str
    at_step: int
    export_to: str = ""  # see `Checkpointed`


@dataclass(frozen=True)
class Stop:
    pass


Command = Start | Prepare | SwitchAt | Drop | CheckpointAt | Stop


class Inbox(Protocol):
    def get(self, timeout: float | None) -> Command | None:
        """The next command: wait up to `timeout` seconds (None: until one comes; 0: do not)."""


class _Stores:
    """The store client of the latest address asked for, connected once (a replayed command
    reuses it) in a thread of its own, so that a training member steps on while it connects to a
    change's store. That can take seconds: a store whose host is not listening yet, or torch's
    lookup of the address's host name, which waits the resolver's timeout (5 s by default) when
    the DNS server drops the query. An older client is dropped here, kept only by the member or
    world still using it."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.latest: tuple[StoreAddress, Future[Store]] | None = None

    def connect(self, address: StoreAddress) -> Future[Store]:
        """The client of `address`, connecting unless it is already."""
        if self.latest is None or self.latest[0] != address:
            future: Future[Store] = Future()
            threading.Thread(target=self._connect, args=(address, future), daemon=True).start()
            self.latest = (address, future)
        return self.latest[1]

    def _connect(self, address: StoreAddress, future: Future[Store]) -> None:
        try:
            timeout = timedelta(seconds=self.timeout)
            future.set_result(TCPStore(address.host, address.port, None, False, timeout))
        except RuntimeError as err:  # torch's: nothing answered there within the timeout
            future.set_exception(err)

    def __call__(self, address: StoreAddress) -> Store:
        """The client of `address`, connected (waiting for it); raises what the connect did."""
        try:
            return self.connect(address).result()
        except RuntimeError:
            self.latest = None  # asked again, it connects again
            raise

    def connecting(self, command: Command, grace: float = 0.0) -> bool:
        """Whether `command` waits for a store that is still connecting after `grace` seconds."""
        if not isinstance(command, Prepare):
            return False
        future = self.connect(command.store)
        wait([future], timeout=grace)
        return not future.done()


def run_member(
    member: Member,
    inbox: Inbox,
    report: Report,
    before_step: Callable[[Member], None] | None = None,
    after_update: Callable[[Member], None] | None = None,
) -> None:
    """Run `member` until a `Stop` command. Reports `Stepped` after every step it trains (once
    its update is applied), `Switched` and `Checkpointed` (or `CheckpointFailed`) as they happen,
    `Broke` when its world breaks, `Finished` once when the job has trained its last step, and
    `Refused` for a refused command. `before_step` runs before each step (a periodic checkpoint
    requested there is agreed in that very step), `after_update` after its `Stepped` (and
    before ZeRO-1 shares the update: `Trainer.step`)."""
    stores = _Stores(member.deadlines.op)
    member.on_decided = report
    held: Command | None = None  # taken, waiting for its store while the member trains
    finished = False
    while True:
        state = member.state
        busy = state is MemberState.TRAINING
        waiting = state in (MemberState.JOINING, MemberState.RECOVERING)
        # A command is obeyed before the next is taken (the inbox settles it then), so none is
        # taken while one is held.
        command = held if held is not None else inbox.get(0 if busy or waiting else None)
        if isinstance(command, Stop):
            return
        grace = _CONNECT_GRACE if held is None else 0.0  # waited once, as it is taken
        waits = busy and command is not None and stores.connecting(command, grace)
        held = command if waits else None
        if command is not None and held is None:
            _obey(member, command, stores, report)
            continue
        if busy:
            if before_step is not None:
                before_step(member)
            try:
                _train_step(member, report, after_update)
            except RuntimeError as err:  # torch's: a collective failed, the world is broken
                breakage, dropped = member.break_world(err)
                report(Broke(member.name, member.epoch, breakage))
                for event in dropped:
                    report(event)
        elif waiting:
            try:
                switched = member.join()
            except RuntimeError as err:  # torch's: the change's store is gone (its host died)
                switched = _store_lost(member, err)
            if switched is None:
                time.sleep(_JOIN_POLL)
            else:
                report(switched)
        if member.done and not finished and member.state is not MemberState.UNDECIDED:
            member.abandon()
            try:
                saved = member.at_end()
            except RuntimeError as err:  # torch's: a member of the world never came to save
                report(Refused(CheckpointAt.__name__, f"{type(err).__name__}: {err}"))
            else:
                if saved is not None:
                    report(saved)
            report(Finished(member.name, member.step))
            finished = True


def _store_lost(member: Member, error: RuntimeError) -> Switched | None:
    """A joining or recovering member whose change's store failed: the change is given up
    here (the operator begins another, on another store); the member waits as it was."""
    if member.pending is None:
        raise error
    reason = f"the store of epoch {member.pending.change.epoch} failed: {error}".split("\n")[0]
    return member.drop(member.pending.change.epoch, reason, Cause.PEER_FAILED)


def _train_step(
    member: Member, report: Report, after_update: Callable[[Member], None] | None
) -> None:
    layout, epoch = member.layout, member.epoch
    assert layout is not None

    def stepped(record: StepRecord) -> None:
        report(Stepped(member.name, epoch, layout.describe(), member.speaks, record,
                       layout.pp_layers))  # fmt: skip
        if after_update is not None:
            after_update(member)

    member.train_step(stepped)
    for event in member.at_boundary():
        report(event)


def _obey(member: Member, command: Command, stores: _Stores, report: Report) -> None:
    try:
        if isinstance(command, Start):
            member.use_store(stores(command.store))
            if command.restore is None:
                member.start(command.layout, command.epoch)
            else:
                member.restore(command.layout, command.restore, command.epoch)
        elif isinstance(command, Prepare):
            member.use_store(stores(command.store))
            for superseded in member.request(command.change):
                report(superseded)
        elif isinstance(command, SwitchAt) and member.state is MemberState.UNDECIDED:
            report(member.decided(command.epoch, commit=True))  # some member read a commit
        elif isinstance(command, SwitchAt):
            member.set_switch_step(command.epoch, command.at_step)
        elif isinstance(command, Drop):
            report(member.drop(command.epoch, command.reason))
        elif isinstance(command, CheckpointAt):
            saved = member.request_checkpoint(
                command.number, command.path, command.at_step, command.export_to
            )
            if saved is not None:
                report(saved)
    except LiveshardError as err:
        report(Refused(type(command).__name__, str(err)))
    except RuntimeError as err:  # torch's: a peer that never came, a broken connection
        report(Refused(type(command).__name__, f"{type(err).__name__}: {err}"))
