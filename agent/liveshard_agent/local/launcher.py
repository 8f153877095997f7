"""`liveshard-local`: a job as local processes, with scripted live layout switches.

    liveshard-local --model tiny --steps 60 --nprocs 4 --switch 20:tp=2,dp=2 --switch 40:pp=2,dp=2

The launcher is the job's driver, as the operator is on Kubernetes: it hosts the job's store,
starts one process per member (gloo on CPU, NCCL on GPUs), and for each scripted switch sends the
change to every member of the old and the new layout as soon as the previous switch has ended, so
the next world is prepared while the job trains; the members switch at the first step boundary
at or after the scripted step at which all of them are prepared. A switch may change the member
count: members beyond the new layout's size stand by (their processes stay up and can be brought
back), and new members get a process of their own, started (pre-warmed) when the change is sent.

A member whose process dies without notice (`--kill STEP:RANK`: the member at RANK kills its own
process, SIGKILL, as it begins step STEP) is answered as on Kubernetes: the survivors' world
breaks, and the driver sends a recovery, the same layout with the dead member's place given to a
standing-by or new process and the dead member `lost`, whose bytes come from surviving copies (a
scripted switch in flight is superseded and sent again afterwards). When no surviving copy or no
common state exists, the recovery aborts; the job then restarts from its last checkpoint saved in
this run (`--checkpoint-every`), as the operator restores a job: every process goes, fresh ones
load the checkpoint in the layout in effect, and the steps since it are trained again (a
`"restored"` line says from where and why). Without such a checkpoint the job stops with the
reason. When every member's world broke and none died (a member slower than the op deadline,
`--stall`), the driver rebuilds the world in the same layout from the step they stopped at (a
switch line with `"trigger": "rebuild"`).

Output (`output`): one JSON line per step (`"event": "step"`), per switch (`"event": "switch"`),
per lost member (`"event": "lost"`), per member whose world broke (`"event": "broken"`) and per
restart from a checkpoint (`"event": "restored"`), or a
human-readable progress view when stdout is a terminal (`--json` forces JSON lines).

Each member's process is a fresh interpreter (multiprocessing's `spawn`), as a pod's is, so the
pre-warm and restart times it shows are a real start's. `LIVESHARD_LOCAL_START_METHOD=forkserver`
forks them instead from a server process that imported torch and the member's code once: a start
in milliseconds instead of seconds, for test suites that start hundreds of jobs.

This module is the driver and the command; the job it runs is a `job.LocalJob`, each member runs
in a `process`, and `--kill` is the `faults` harness. The driver branches on the members' typed
events (`runtime.events`) and turns them into output lines in one place, `output`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import torch
from torch.distributed import TCPStore

from liveshard_core.assign.assign import placed_members
from liveshard_core.cli import parse_bytes
from liveshard_core.errors import InvalidInput
from liveshard_core.job import Cause
from liveshard_core.job.flags import add_training_flags, training_from_flags
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import Degrees, Layout, parse_degrees
from liveshard_core.plan.predict import predicted_pause
from liveshard_core.plan.union import union_members
from liveshard_core.policy.model import state_bytes_per_layer
from liveshard_core.policy.rebalance import GROW, PACK, REBALANCE, CostWindow, propose

from ..data.builtin import PRESET
from ..engine.errors import DecisionUnknown
from ..engine.sealed import JobStore
from ..engine.vote import Failure, settle
from ..engine.world import StoreAddress
from ..runtime.change import Change
from ..runtime.events import (
    Broke,
    Checkpointed,
    CheckpointFailed,
    Decided,
    Finished,
    Refused,
    Stepped,
    Switched,
    Undecided,
)
from ..runtime.loop import Drop, Prepare, Start, Stop, SwitchAt
from . import output
from .faults import Fault, ScriptedKill, parse_kill
from .job import LocalJob, ScriptedSwitch, local_config, parse_switch
from .output import Line
from .process import Crashed, member_main
from .start import start_context

__all__ = [
    "Driver",
    "Fault",
    "LocalJob",
    "ScriptedKill",
    "ScriptedSwitch",
    "local_config",
    "main",
    "parse_kill",
    "parse_switch",
    "run_job",
]

HOST = "127.0.0.1"
LOCAL_BANDWIDTH = 1e9  # bytes per second between local processes, for the dry run


RECOVERY, REBUILD = "recovery", "rebuild"  # the triggers of changes that answer a broken world

# ---- the driver ----


@dataclass
class _Process:
    name: str
    proc: Any
    conn: Connection


class Driver:
    """Runs a `LocalJob`: its processes, its store, its scripted switches; `emit` gets every
    output line (`output`) of the job, in order."""

    def __init__(self, job: LocalJob, emit: Callable[[Line], None]) -> None:
        job.check()
        self.job, self.emit = job, emit
        self.spec = job.spec()
        self.ctx = start_context([member_main.__module__])
        self.store = TCPStore(
            HOST, 0, None, True, timedelta(seconds=job.deadlines.op), wait_for_workers=False
        )
        self.address = StoreAddress(HOST, self.store.port)
        self.sealed = JobStore(self.store, job.seal())
        self.processes: dict[str, _Process] = {}
        self.names = (f"w{i}" for i in range(1 << 30))
        self.layout: Layout | None = None
        self.standby: list[str] = []
        self.epoch = 0
        self.script: Iterator[ScriptedSwitch] = iter(job.switches)
        self.pending: Change | None = None
        self.scripted: ScriptedSwitch | None = None  # the pending change's, if scripted
        self.lost: set[str] = set()  # members of the layout in effect whose process died
        self.broke: dict[str, float] = {}  # members whose world broke: when they said so
        self.trigger: Line = {}  # what asked for the pending change, for its switch line
        self.rebalance = job.config.rebalance
        self.window = CostWindow(self.rebalance.window_steps)  # in the layout in effect
        self.left: list[tuple[int, ...]] = []  # partitions a rebalance left
        self.max_stages = job.layout.pp  # the stages packing may grow back to
        self.pause = 0.0  # the longest pause measured so far
        self.saved: Checkpointed | None = None  # the last checkpoint saved in this run
        self.heard: Switched | None = None  # the pending change's commit, as a silent member saw it
        self.unheard: tuple[int, Line] | None = None  # a change adopted without its line yet
        self.accounts: dict[int, dict[str, bool]] = {}  # epoch: member: it committed (Decided)
        self.undecided: dict[str, tuple[int, str]] = {}  # member: its epoch, why it cannot read

    def _spawn(self, name: str) -> None:
        parent, child = self.ctx.Pipe()
        index = len(self.processes)
        proc = self.ctx.Process(
            target=member_main, args=(name, index, self.job, child), daemon=True
        )
        proc.start()
        child.close()
        self.processes[name] = _Process(name, proc, parent)

    def run(self) -> None:
        try:
            members = [next(self.names) for _ in range(self.job.nprocs)]
            for name in members:
                self._spawn(name)
            self.layout = self.job.layout.layout(self.spec, members)
            start = Start(self.layout, self.address, restore=self.job.resume)
            for name in members:
                self.processes[name].conn.send(start)
            self._request_next()
            self._loop()
        finally:
            self.close()

    def _request_next(self) -> None:
        assert self.layout is not None
        switch = next(self.script, None)
        self.scripted = switch
        if switch is None:
            self.pending = None
            return
        size = switch.degrees.world_size
        current = list(self.layout.members)
        if switch.members is not None:
            members = list(switch.members)
            self.standby = [m for m in self.standby if m not in members]
        else:
            members = current[:size]
            while len(members) < size and self.standby:
                members.append(self.standby.pop(0))
            members += [next(self.names) for _ in range(size - len(members))]
        for name in members:
            if name not in self.processes:
                self._spawn(name)  # pre-warm: it starts while the job trains
        self._request(
            switch.degrees.layout(self.spec, members), switch.step, {"trigger": "scripted"}
        )

    def _request(self, new: Layout, at_step: int, trigger: Line) -> None:
        """Send the change to `new` to every member of the layout in effect and of `new`."""
        assert self.layout is not None
        self.epoch += 1
        change = Change(
            epoch=self.epoch, old=self.layout, new=new, at_step=at_step, budget=self.job.budget
        )
        self.pending, self.trigger = change, trigger
        for name in dict.fromkeys(self.layout.members + new.members):
            self.processes[name].conn.send(Prepare(change, self.address))

    def _loop(self) -> None:
        done: set[str] = set()
        while True:
            assert self.layout is not None
            if set(self.layout.members) <= done:
                self._unmade()
                return
            conns = {p.conn: p for p in self.processes.values()}
            for ready in wait(list(conns), timeout=1.0):
                process = conns[cast(Connection, ready)]
                if process.name not in self.processes:
                    continue  # found dead with another
                try:
                    message = process.conn.recv()
                except (EOFError, OSError):
                    self._lost(process)
                    continue
                self._receive(process.name, message, done)
            self._kill_silent()

    def _unmade(self) -> None:
        """Say which asked-for switches the job ended before making: the pending one (its
        members were not all prepared in time) and the scripted ones after it."""
        last = self.job.settings.steps - 1
        if self.pending is not None:
            self.emit(output.unmade_line(self.pending.new.describe(), self.pending.at_step, last))
        for switch in self.script:
            self.emit(output.unmade_line(switch.degrees.describe(), switch.step, last))

    def _kill_silent(self) -> None:
        """Members of the layout in effect that said nothing for `Deadlines.silent` after their
        peers' world broke are stopped or hung: they are killed, and their loss answered."""
        assert self.layout is not None
        silent = self.job.deadlines.silent
        if not self.broke or time.monotonic() - min(self.broke.values()) < silent:
            return
        for name in self.layout.members:
            process = self.processes.get(name)
            if name not in self.broke and process is not None and process.proc.is_alive():
                self.emit(output.silent_line(name, silent))
                process.proc.kill()
                process.proc.join()  # found dead by the loop, once

    def _receive(self, name: str, message: object, done: set[str]) -> None:
        """One message from member `name`'s process: an event of its loop, or its crash."""
        match message:
            case Refused(command=Prepare.__name__, message=why) if name in self.broke:
                self._refused_broken(name, why)
            case Crashed(message=why) | Refused(message=why):
                raise RuntimeError(f"member {name} failed: {why}")
            case Stepped(speaks=speaks, record=record):
                if speaks:
                    self.emit(output.step_line(message, self.job.settings.tokens_per_step))
                    self._measured(message)
                if self.job.record_samples and record.samples:
                    self.emit(output.samples_line(message))
            case Checkpointed() | CheckpointFailed():
                if isinstance(message, Checkpointed):
                    self.saved = message
                self.emit(output.checkpoint_line(message))
            case Broke(epoch=epoch):
                self._adopt_broken(epoch)
                self.broke.setdefault(name, time.monotonic())
                self.emit(output.broken_line(message))
                self._rebuild()
            case Finished():
                done.add(name)
            case Switched():
                self.accounts.setdefault(message.epoch, {})[name] = message.committed
                self._tell_undecided()
                self._settled(message)
            case Undecided(epoch=epoch, reason=why):
                self.undecided[name] = (epoch, why)
                self._tell_undecided()
            case Decided(epoch=epoch, committed=committed):
                self.accounts.setdefault(epoch, {})[name] = committed
                self._tell_undecided()
            case _:
                raise RuntimeError(f"member {name} sent {message!r}, which is no event")

    def _adopt_broken(self, epoch: int) -> None:
        """A member's world of `epoch` broke: if that is the pending change's, the change
        committed, though the account that speaks for it may never come (its member is the one
        stopped): its new layout is the one in effect, whose members' breaks and silence count
        (not the old layout's, whose leaving members are done and say nothing more)."""
        change = self.pending
        if change is not None and change.epoch == epoch:
            self._adopt(change)
            self._say_adopted(change)

    def _refused_broken(self, name: str, why: str) -> None:
        """A member whose world broke refused a change: it takes only a recovery or a rebuild,
        which its break leads to. A change asked before the break was seen here (the next
        scripted switch, once a commit's account came while the new world broke) is aborted and
        asked again after it; a refusal of a change already given up is moot."""
        change = self.pending
        if change is None or self._recovering():
            return
        self._decision(
            change.epoch, Failure(Cause.PEER_FAILED, f"epoch {change.epoch}: {name}: {why}")
        )
        self._postpone()

    def _lost(self, process: _Process) -> None:
        """A member's process died: recover without it (and any other member found dead) when it
        was a member of the layout in effect (the others cannot go on without its state). A
        death inside a pending switch first settles the switch: the launcher records an abort as
        its decision unless a commit was recorded first, in which case the layout in effect is
        the switch's new one. A member of neither (a joining member whose switch then aborts, a
        leaving one after the commit) is only buried; any other death fails the job. A death
        found later is answered by a recovery that supersedes this one."""
        assert self.layout is not None
        change = self.pending
        if (
            change is not None
            and not change.lost
            and process.name in union_members(change.old, change.new)
        ):
            why = Failure(Cause.PEER_FAILED, f"epoch {change.epoch}: {process.name} died")
            if not self._decision(change.epoch, why):
                if process.name not in self.layout.members:
                    self._bury([process])  # a joining member: the switch aborts without it
                    return
            elif process.name in change.new.ranks:
                self._adopt(change)  # it died after the commit was decided
                self._say_adopted(change)
            else:
                self._bury([process])  # a leaving member, after the commit
                return
        if process.name not in self.layout.members:
            process.proc.join(5)
            raise RuntimeError(f"member {process.name} exited (code {process.proc.exitcode})")
        dead = [process] + [
            p for p in self.processes.values()
            if p is not process and p.name in self.layout.members and not p.proc.is_alive()
        ]  # fmt: skip
        self._bury(dead)
        self.lost.update(gone.name for gone in dead)
        if self.pending is not None and not self.pending.lost:
            self._postpone()  # superseded by the recovery
        members = list(self.layout.members)
        for name in self.lost:
            members[members.index(name)] = self._standing_by()
        self._recover(members, RECOVERY)

    def _rebuild(self) -> None:
        """Every member of the layout in effect said its world broke and none is lost (a
        partition, a member slower than the op deadline): rebuild the world in the same layout
        from the step they stopped at, as the operator does."""
        assert self.layout is not None
        if self.lost or not set(self.layout.members) <= self.broke.keys():
            return
        if self.pending is not None:
            if self._recovering():
                return
            self._postpone()  # superseded by the rebuild
        self._recover(list(self.layout.members), REBUILD)

    def _recover(self, members: list[str], trigger: str) -> None:
        """Ask for the change from the layout in effect to the same degrees over `members`, the
        lost ones (`self.lost`) replaced: a recovery, or a rebuild when none is lost."""
        assert self.layout is not None
        self.epoch += 1
        change = Change(
            epoch=self.epoch, old=self.layout,
            new=dataclasses.replace(self.layout, members=tuple(members)), at_step=0,
            lost=frozenset(self.lost), budget=self.job.budget,
        )  # fmt: skip
        self.pending, self.scripted, self.trigger = change, None, {"trigger": trigger}
        for name in dict.fromkeys(self.layout.members + change.new.members):
            if name in self.processes:
                with contextlib.suppress(BrokenPipeError, OSError):  # dead too: seen next
                    self.processes[name].conn.send(Prepare(change, self.address))

    def _recovering(self) -> bool:
        """Whether the pending change answers a broken world (a recovery or a rebuild; a
        scripted switch to the layout in effect is neither)."""
        return self.trigger.get("trigger") in (RECOVERY, REBUILD)

    def _say_adopted(self, change: Change) -> None:
        """The switch line of `change`, adopted when a member died after its commit: the one
        member that speaks for the new world may be the dead one, or speak later; the first
        account of the commit that comes, any member's, is the line."""
        heard = self.heard
        if heard is not None and heard.epoch == change.epoch:
            self.emit({**output.switch_line(heard), **self.trigger})
        else:
            self.unheard = (change.epoch, self.trigger)

    def _bury(self, dead: list[_Process]) -> None:
        for gone in dead:
            gone.proc.join(5)
            del self.processes[gone.name]
            self.emit(output.lost_line(gone.name, gone.proc.exitcode))

    def _adopt(self, change: Change) -> None:
        """`change` committed: its new layout is the one in effect."""
        assert self.layout is not None
        left = [m for m in change.old.members if m not in change.new.ranks]
        self.standby += [m for m in left if m not in change.lost]
        if self.trigger.get("trigger") in (REBALANCE, PACK, GROW):
            self.left = [change.old.pp_layers, *self.left][:8]
        elif not change.lost:
            self.max_stages = change.new.pp
        self.layout = change.new
        self.window.clear()
        self.lost.clear()
        self.broke.clear()
        self.pending, self.scripted = None, None

    def _postpone(self) -> None:
        """Give up the pending scripted switch until the recovery has committed."""
        pending, scripted = self.pending, self.scripted
        assert pending is not None
        if scripted is not None:
            self.script = itertools.chain([scripted], self.script)
        self.standby += [m for m in pending.new.members if m not in pending.old.ranks]
        self.pending, self.scripted = None, None

    def _restore(self, why: str) -> None:
        """Restart the job from the last checkpoint saved in this run: every process goes, as
        many fresh ones as the layout in effect has load it in that layout, and the scripted
        switches not yet made follow. RuntimeError with `why` when there is none."""
        assert self.layout is not None and self.pending is not None
        saved = self.saved
        if saved is None:
            raise RuntimeError(f"{why}; no checkpoint was saved in this run to restore from "
                               "(--checkpoint-dir, --checkpoint-every)")  # fmt: skip
        self._postpone()
        for process in self.processes.values():
            process.proc.kill()
            process.proc.join()
        self.processes.clear()
        self.standby, self.lost, self.broke = [], set(), {}
        self.window = CostWindow(self.rebalance.window_steps)
        members = [next(self.names) for _ in range(self.layout.world_size)]
        for name in members:
            self._spawn(name)
        self.layout = self.layout.degrees.layout(self.spec, members)
        self.epoch += 1
        self.emit(output.restored_line(saved, self.epoch, why))
        for name in members:
            self.processes[name].conn.send(
                Start(self.layout, self.address, epoch=self.epoch, restore=saved.path)
            )
        self._request_next()

    def _standing_by(self) -> str:
        """A member to take a place: one standing by, or a new process."""
        while self.standby:
            name = self.standby.pop(0)
            if name in self.processes:
                return name
        name = next(self.names)
        self._spawn(name)
        return name

    def _decision(self, epoch: int, proposal: Failure) -> bool | None:
        """Whether `epoch` committed, as the launcher reads its decision in the store it hosts,
        recording `proposal` (an abort) unless a decision was recorded first. Where the value
        there is refused (it lacks the job's seal: a forger may have overwritten what some
        members read), from the members' accounts: committed when one acts on a commit, aborted
        once every member of the change is undecided, gave it up or is dead; None until then."""
        try:
            return settle(self.sealed, epoch, proposal) is None
        except DecisionUnknown:
            accounts = self.accounts.get(epoch, {})
            if any(accounts.values()):
                return True
            change = self.pending
            if change is None or change.epoch != epoch:
                return False  # given up, superseded
            settled = set(accounts) | set(self.undecided)
            alive = {n for n, p in self.processes.items() if p.proc.is_alive()}
            union = union_members(change.old, change.new)
            return False if all(m in settled or m not in alive for m in union) else None

    def _tell_undecided(self) -> None:
        """Tell each member that could not read its switch's decision what it was, once known
        (`SwitchAt` commits an undecided switch, `Drop` aborts it)."""
        for name, (epoch, why) in list(self.undecided.items()):
            told = Failure(Cause.VOTE_INCOMPLETE, f"epoch {epoch}: {name} could not read it")
            commit = self._decision(epoch, told)
            if commit is None:
                continue
            del self.undecided[name]
            process = self.processes.get(name)
            if process is not None:
                process.conn.send(SwitchAt(epoch, 0) if commit else Drop(epoch, why))

    def _settled(self, event: Switched) -> None:
        """A member's account of a switch: the job goes on from the reported one of the pending
        change; a recovery that aborts anywhere ends the job."""
        if self.unheard is not None and event.epoch == self.unheard[0] and event.committed:
            self.emit({**output.switch_line(event), **self.unheard[1]})
            self.unheard = None
            return
        change = self.pending
        if change is None or event.epoch != change.epoch:
            return  # a superseded change, given up
        if self._recovering() and not event.committed:
            what = f"the loss of {sorted(change.lost)}" if change.lost else "a broken world"
            self._restore(f"the recovery from {what} failed: {event.reason}")
            return
        if not event.report:
            if event.committed:
                self.heard = event
            return
        if not event.committed and event.cause is Cause.PEER_FAILED:
            # A member died or a transfer failed: try again later (after the recovery or the
            # rebuild, when a member of the layout in effect died or its world broke: seen next).
            self.emit({**output.switch_line(event), **self.trigger})
            self._postpone()
            if not self.lost and not self.broke:
                self._request_next()
            return
        self._switched(event)

    def _switched(self, event: Switched) -> None:
        change = self.pending
        assert change is not None and self.layout is not None
        self.emit({**output.switch_line(event), **self.trigger})
        self.pause = max(self.pause, event.pause_seconds)
        if event.committed:
            self._adopt(change)
        else:
            joined = [m for m in change.new.members if m not in change.old.ranks]
            self.standby += joined
        # A settled change's accounts are read no more, unless a member is undecided in it.
        waiting = {epoch for epoch, _ in self.undecided.values()}
        self.accounts = {e: a for e, a in self.accounts.items() if e > change.epoch or e in waiting}
        self._request_next()

    # ---- live rebalancing ----

    def _measured(self, event: Stepped) -> None:
        """Rebalance the pipeline (`policy.rebalance`) when the costs measured in the layout in
        effect call for it and no other change is pending."""
        layout, record = self.layout, event.record
        if not self.rebalance.enabled or layout is None or event.layout != layout.describe():
            return
        self.window.add(record.costs)
        costs = self.window.median()
        if self.pending or self.lost or not self.window.full or costs is None:
            return
        if record.step + 2 >= self.job.settings.steps:
            return  # no step left to win back a pause
        proposal = propose(
            self.rebalance, costs, layout.pp_layers,
            self.job.settings.micro_batches(layout.dp), self._predicted_pause,
            max_stages=self.max_stages, left=self.left,
            memory=state_bytes_per_layer(self.spec, layout), memory_cap=self._memory_cap(),
        )  # fmt: skip
        if proposal is None:
            return
        degrees = layout.degrees.repartitioned(proposal.pp_layers)
        new = self._placed(degrees)
        released = [m for m in layout.members if m not in new.ranks]  # stand by after it
        self._request(new, record.step + 1, {
            "trigger": proposal.kind, "released": released,
            "predicted_step_seconds": [round(proposal.step_seconds_before, 6),
                                       round(proposal.step_seconds_after, 6)],
            "predicted_pause_seconds": round(proposal.pause_seconds, 6),
            "imbalance": [round(proposal.imbalance_before, 4), round(proposal.imbalance_after, 4)],
        })  # fmt: skip

    def _placed(self, degrees: Degrees) -> Layout:
        """`degrees` laid out on the members that hold most of what their new ranks need (the
        others stand by; a missing member is one standing by, or a new process)."""
        assert self.layout is not None
        members = placed_members(
            self.spec, self.layout, degrees, self.layout.members, self._standing_by
        )
        return degrees.layout(self.spec, members)

    def _predicted_pause(self, pp_layers: tuple[int, ...]) -> float:
        """The dry run's pause over local links, at least the longest pause measured so far."""
        assert self.layout is not None
        old = self.layout
        degrees = old.degrees.repartitioned(pp_layers)
        new = degrees.layout(self.spec, [str(i) for i in range(degrees.world_size)])
        old = dataclasses.replace(old, members=tuple(str(i) for i in range(old.world_size)))
        predicted = predicted_pause(self.spec, old, new, self.job.budget, LOCAL_BANDWIDTH)
        return max(predicted, self.pause)

    def _memory_cap(self) -> int | None:
        """Bytes of training state a member may hold: half a GPU's memory (the rest is for
        activations); none on CPU."""
        if self.job.device != "cuda":
            return None
        return torch.cuda.get_device_properties(0).total_memory // 2

    def close(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(BrokenPipeError, OSError):
                process.conn.send(Stop())
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            process.proc.join(max(deadline - time.monotonic(), 0.1))
            if process.proc.is_alive():
                process.proc.kill()


def run_job(job: LocalJob) -> list[Line]:
    """Run `job` to its end and return every line it output, in order."""
    events: list[Line] = []
    Driver(job, events.append).run()
    return events


# ---- the command ----


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liveshard-local", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=PRESET,
                        help="a Hugging Face model directory, a preset name or a JSON/YAML "
                             "model file (default: qwen3-tiny, the built-in tiny Qwen3 "
                             "directory, whose BPE tokenizer was trained on the built-in "
                             "corpus)")  # fmt: skip
    parser.add_argument("--init", choices=["pretrained", "random"],
                        help="start from the model directory's weights (the default when it "
                             "has them) or from a fresh initialisation")  # fmt: skip
    parser.add_argument("--nprocs", type=int, default=4, help="members at the start")
    parser.add_argument("--layout", help="the first layout (default dp=NPROCS)")
    parser.add_argument("--switch", action="append", default=[], metavar="STEP:LAYOUT",
                        help="switch to LAYOUT at step STEP (repeatable)")  # fmt: skip
    parser.add_argument("--kill", action="append", default=[], metavar="STEP:RANK[:PHASE]",
                        help="the member at RANK kills its process at PHASE: step (the "
                             "default: as it begins step STEP), update (after step STEP's "
                             "update, before ZeRO-1 shares it), or prepare, transfer, vote, "
                             "commit (inside the switch scripted at STEP); repeatable: the job "
                             "recovers from surviving copies")  # fmt: skip
    parser.add_argument("--hang", action="append", default=[], metavar="STEP:RANK[:PHASE]",
                        help="as --kill, but the member stops (SIGSTOP): found silent when its "
                             "peers' world breaks, it is killed and the job recovers")  # fmt: skip
    parser.add_argument("--stall", action="append", default=[], metavar="STEP:RANK[:PHASE]",
                        help="as --kill, but the member's training sleeps 1.5 op deadlines: "
                             "every member's world breaks, none is lost, and the job rebuilds "
                             "its world in the same layout")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when available, else cpu")  # fmt: skip
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"],
        help="parameter dtype (default: fp32 on CPU, the model's on GPUs)",
    )  # fmt: skip
    parser.add_argument("--budget", default="256MiB", help="transfer buffer bytes per member")
    parser.add_argument(
        "--checksums", action="store_true",
        help="digest whole-state checksums before and after each switch",
    )  # fmt: skip
    parser.add_argument("--checkpoint-dir", help="where --checkpoint-every saves (DIR/step-N)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="save a checkpoint every N steps")  # fmt: skip
    parser.add_argument("--resume", metavar="DIR",
                        help="start from a checkpoint (saved in any layout)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    rebalance = parser.add_argument_group("live rebalancing")
    rebalance.add_argument(
        "--rebalance",
        action="store_true",
        help="repartition the pipeline live from the layers' measured costs",
    )
    rebalance.add_argument(
        "--rebalance-threshold",
        type=float,
        default=RebalanceSettings.threshold,
        help="switch when the predicted step time drops by more than this "
        "share (default %(default)s)",
    )
    rebalance.add_argument(
        "--rebalance-window",
        type=int,
        default=RebalanceSettings.window_steps,
        help="steps of costs a decision reads, their median (default %(default)s)",
    )
    rebalance.add_argument("--pack", action="store_true",
                           help="with --rebalance: use fewer pipeline stages when the work fits "
                                "(their members stand by), more again when it grows")  # fmt: skip
    add_training_flags(parser, defaults={"steps": 60})
    return parser


def job_from_args(args: argparse.Namespace) -> LocalJob:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layout = parse_degrees(args.layout) if args.layout else Degrees(dp=args.nprocs)
    config = local_config(
        args.model, training_from_flags(args), device=device, precision=args.precision,
        budget=parse_bytes(args.budget), init=args.init,
        rebalance=RebalanceSettings(args.rebalance or args.pack, args.rebalance_threshold,
                                    args.rebalance_window, args.pack),
    )  # fmt: skip
    switches = sorted((parse_switch(s) for s in args.switch), key=lambda s: s.step)
    return LocalJob(
        config=config, nprocs=args.nprocs, layout=layout, switches=tuple(switches),
        checksums=args.checksums,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, kills=tuple(parse_kill(k) for k in args.kill)
        + tuple(parse_kill(k, Fault.HANG) for k in args.hang)
        + tuple(parse_kill(k, Fault.STALL) for k in args.stall),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        job = job_from_args(args)
        Driver(job, output.printer(args.json or not sys.stdout.isatty())).run()
    except InvalidInput as err:
        print(f"liveshard-local: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
