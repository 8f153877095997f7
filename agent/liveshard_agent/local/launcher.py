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
common state exists, the recovery aborts and the job stops with its reason: only a checkpoint
(`--resume`) can restore it.

Output: one JSON line per step (`"event": "step"`), per switch (`"event": "switch"`), per lost
member (`"event": "lost"`) and per member whose world broke (`"event": "broken"`), or a
human-readable progress view when stdout is a terminal (`--json` forces JSON lines).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import torch
from torch.distributed import TCPStore

from liveshard_core.cli import parse_bytes
from liveshard_core.errors import InvalidInput
from liveshard_core.job import DEFAULT_BUDGET, Deadlines, JobConfig, TrainingSettings
from liveshard_core.job.flags import add_training_flags, training_from_flags
from liveshard_core.layout.layout import Degrees, Layout, parse_degrees
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import ModelSpec

from ..engine.errors import Cause
from ..engine.world import StoreAddress
from ..runtime.loop import Command, Prepare, Start, Stop, run_member
from ..runtime.member import Change, Member
from ..runtime.trainer import StepRecord

HOST = "127.0.0.1"
LOCAL_DEADLINES = Deadlines(op=60.0, switch=120.0, prepare=300.0)


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


@dataclass(frozen=True)
class ScriptedKill:
    """The member at `rank` of the layout in effect kills its own process (SIGKILL) as it begins
    step `step`: a failure without notice, at a known point."""

    step: int
    rank: int


def parse_kill(text: str) -> ScriptedKill:
    """`STEP:RANK`, e.g. `15:1`."""
    step, sep, rank = text.partition(":")
    if not sep or not step.strip().isdigit() or not rank.strip().isdigit():
        raise InvalidInput(f"--kill {text!r}: expected STEP:RANK, e.g. 15:1")
    return ScriptedKill(int(step), int(rank))


def local_config(
    model: str,
    settings: TrainingSettings,
    *,
    device: str = "cpu",
    precision: str | None = None,
    budget: int = DEFAULT_BUDGET,
) -> JobConfig:
    """A local job's configuration: `model` a preset name or a JSON/YAML model file."""
    return JobConfig(
        model=resolve_model(model).config, precision=precision, device=device,
        training=settings, deadlines=LOCAL_DEADLINES, budget_bytes=budget,
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
    hooks: str | None = None  # "module:function" making each member's SwitchHooks (tests)
    kills: tuple[ScriptedKill, ...] = ()

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
                f"--layout {self.layout} has {self.layout.world_size} ranks, not --nprocs "
                f"{self.nprocs}"
            )
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


# ---- a member's process ----


class _PipeInbox:
    """The driver's commands, from the member's end of its pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, timeout: float | None) -> Command | None:
        if not self.conn.poll(timeout):
            return None
        return cast(Command, self.conn.recv())


def _member_main(name: str, index: int, job: LocalJob, conn: Connection) -> None:
    try:
        torch.set_num_threads(1)
        device = (
            torch.device("cuda", index % torch.cuda.device_count())
            if job.device == "cuda"
            else torch.device("cpu")
        )
        hooks = None
        if job.hooks is not None:
            module, _, function = job.hooks.partition(":")
            hooks = getattr(importlib.import_module(module), function)(name)
        member = Member(
            name=name, spec=job.spec(), settings=job.settings, device=device,
            deadlines=job.deadlines, job="local", checksums=job.checksums, hooks=hooks,
        )  # fmt: skip
        run_member(member, _PipeInbox(conn), _reporter(name, job, conn), _before_step(job))
    except BaseException as err:
        message = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        conn.send(("error", {"member": name, "message": message}))


def _reporter(name: str, job: LocalJob, conn: Connection) -> Callable[[str, dict[str, Any]], None]:
    """Sends the driver what it prints: steps from the world's rank 0, switches, checkpoints."""

    def report(kind: str, event: dict[str, Any]) -> None:
        if kind == "step":
            record = event["record"]
            if event["speaks"]:
                conn.send(("event", _step_event(record, event["layout"], event["epoch"], job)))
            if job.record_samples and record.samples:
                samples = {"event": "samples", "step": record.step, "member": event["member"],
                           "samples": list(record.samples)}  # fmt: skip
                conn.send(("event", samples))
        elif kind == "checkpoint":
            if event["report"]:
                saved = {k: event[k] for k in ("step", "path", "seconds")}
                conn.send(("event", {"event": "checkpoint", **saved}))
        else:
            conn.send((kind, {"member": name, **event}))

    return report


def _step_event(record: StepRecord, layout: str, epoch: int, job: LocalJob) -> dict[str, Any]:
    return {
        "event": "step", "step": record.step, "loss": record.loss, "layout": layout,
        "epoch": epoch, "step_seconds": round(record.seconds, 6),
        "tokens": job.settings.tokens_per_step, "aux_loss": record.aux_loss,
        "grad_norm": record.grad_norm, "lr": record.lr,
    }  # fmt: skip


def _before_step(job: LocalJob) -> Callable[[Member], None]:
    """`--checkpoint-every N`: every member asks for a checkpoint after each N-th step; `--kill
    STEP:RANK`: the member at RANK dies as it begins step STEP."""
    every, directory, kills = job.checkpoint_every, job.checkpoint_dir, job.kills

    def before_step(member: Member) -> None:
        after = member.step + 1
        if every and after % every == 0:
            assert directory is not None
            path = os.path.join(directory, f"step-{after}")
            member.request_checkpoint(after // every, path, at_step=after)
        assert member.layout is not None
        rank = member.layout.rank_of(member.name)
        for kill in kills:
            # Once per job: the recovery resumes at this step, maybe with another member at RANK.
            once = f"liveshard/kill/{kill.step}:{kill.rank}"
            if (kill.step, kill.rank) == (member.step, rank) and member.store.add(once, 1) == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    return before_step


# ---- the driver ----


@dataclass
class _Process:
    name: str
    proc: Any
    conn: Connection


class Driver:
    """Runs a `LocalJob`: its processes, its store, its scripted switches; `emit` gets every
    event the job reports."""

    def __init__(self, job: LocalJob, emit: Callable[[dict[str, Any]], None]) -> None:
        job.check()
        self.job, self.emit = job, emit
        self.spec = job.spec()
        self.ctx = mp.get_context("spawn")
        self.store = TCPStore(
            HOST, 0, None, True, timedelta(seconds=job.deadlines.op), wait_for_workers=False
        )
        self.address = StoreAddress(HOST, self.store.port)
        self.processes: dict[str, _Process] = {}
        self.names = (f"w{i}" for i in range(1 << 30))
        self.layout: Layout | None = None
        self.standby: list[str] = []
        self.epoch = 0
        self.script: Iterator[ScriptedSwitch] = iter(job.switches)
        self.pending: Change | None = None
        self.scripted: ScriptedSwitch | None = None  # the pending change's, if scripted
        self.lost: set[str] = set()  # members of the layout in effect whose process died

    def _spawn(self, name: str) -> None:
        parent, child = self.ctx.Pipe()
        index = len(self.processes)
        proc = self.ctx.Process(
            target=_member_main, args=(name, index, self.job, child), daemon=True
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
        self.epoch += 1
        change = Change(
            epoch=self.epoch, old=self.layout, new=switch.degrees.layout(self.spec, members),
            at_step=switch.step, budget=self.job.budget,
        )  # fmt: skip
        self.pending = change
        for name in dict.fromkeys(current + members):
            self.processes[name].conn.send(Prepare(change, self.address))

    def _loop(self) -> None:
        done: set[str] = set()
        while True:
            assert self.layout is not None
            if set(self.layout.members) <= done:
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
                kind, event = message
                if kind == "error":
                    raise RuntimeError(f"member {event['member']} failed: {event['message']}")
                if kind == "event":
                    self.emit(event)
                elif kind == "broken":
                    self.emit({"event": "broken", **event})
                elif kind == "done":
                    done.add(event["member"])
                elif kind == "switch":
                    self._settled(event)

    def _lost(self, process: _Process) -> None:
        """A member's process died: recover without it (and any other member found dead) when it
        was a member of the layout in effect (the others cannot go on without its state), else
        the job fails. A death found later is answered by a recovery that supersedes this one."""
        assert self.layout is not None
        if process.name not in self.layout.members:
            process.proc.join(5)
            raise RuntimeError(f"member {process.name} exited (code {process.proc.exitcode})")
        dead = [process] + [
            p for p in self.processes.values()
            if p is not process and p.name in self.layout.members and not p.proc.is_alive()
        ]  # fmt: skip
        for gone in dead:
            gone.proc.join(5)
            del self.processes[gone.name]
            self.emit({"event": "lost", "member": gone.name, "exit_code": gone.proc.exitcode})
            self.lost.add(gone.name)
        if self.pending is not None and not self.pending.lost:
            self._postpone()  # superseded by the recovery
        members = list(self.layout.members)
        for name in self.lost:
            members[members.index(name)] = self._standing_by()
        self.epoch += 1
        change = Change(
            epoch=self.epoch, old=self.layout,
            new=dataclasses.replace(self.layout, members=tuple(members)), at_step=0,
            lost=frozenset(self.lost), budget=self.job.budget,
        )  # fmt: skip
        self.pending, self.scripted = change, None
        for name in dict.fromkeys(self.layout.members + change.new.members):
            if name in self.processes:
                with contextlib.suppress(BrokenPipeError, OSError):  # dead too: seen next
                    self.processes[name].conn.send(Prepare(change, self.address))

    def _postpone(self) -> None:
        """Give up the pending scripted switch until the recovery has committed."""
        pending, scripted = self.pending, self.scripted
        assert pending is not None
        if scripted is not None:
            self.script = itertools.chain([scripted], self.script)
        self.standby += [m for m in pending.new.members if m not in pending.old.ranks]
        self.pending, self.scripted = None, None

    def _standing_by(self) -> str:
        """A member to take a place: one standing by, or a new process."""
        while self.standby:
            name = self.standby.pop(0)
            if name in self.processes:
                return name
        name = next(self.names)
        self._spawn(name)
        return name

    def _settled(self, event: dict[str, Any]) -> None:
        """A member's account of a switch: the job goes on from the reported one of the pending
        change; a recovery that aborts anywhere ends the job."""
        change = self.pending
        if change is None or event["epoch"] != change.epoch:
            return  # a superseded change, given up
        aborted = event["result"] == "aborted"
        if change.lost and aborted:
            raise RuntimeError(
                f"the recovery from the loss of {sorted(change.lost)} failed: {event['reason']}"
            )
        if not event["report"]:
            return
        if aborted and event["cause"] == Cause.PEER_FAILED.value:
            # A member died (its loss is seen next) or a transfer failed: try again later.
            self.emit(self._switch_event(event))
            self._postpone()
            return
        self._switched(event)

    def _switched(self, event: dict[str, Any]) -> None:
        change = self.pending
        assert change is not None and self.layout is not None
        self.emit(self._switch_event(event))
        if event["result"] == "committed":
            left = [m for m in change.old.members if m not in change.new.ranks]
            self.standby += [m for m in left if m not in change.lost]
            self.layout = change.new
            self.lost.clear()
        else:
            joined = [m for m in change.new.members if m not in change.old.ranks]
            self.standby += joined
        self._request_next()

    @staticmethod
    def _switch_event(event: dict[str, Any]) -> dict[str, Any]:
        out = {
            k: v
            for k, v in event.items()
            if k
            not in ("report", "checksums", "from_layout", "to_layout", "switch_seconds", "member")
        }
        out.update({"from": event["from_layout"], "to": event["to_layout"]})
        if event["checksums"]:
            out["checksums"] = event["checksums"]
        out["switch_seconds"] = event["switch_seconds"]
        return {"event": "switch", **out}

    def close(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(BrokenPipeError, OSError):
                process.conn.send(Stop())
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            process.proc.join(max(deadline - time.monotonic(), 0.1))
            if process.proc.is_alive():
                process.proc.kill()


def run_job(job: LocalJob) -> list[dict[str, Any]]:
    """Run `job` to its end and return every event it reported, in order."""
    events: list[dict[str, Any]] = []
    Driver(job, events.append).run()
    return events


# ---- the command ----


def _printer(as_json: bool) -> Callable[[dict[str, Any]], None]:
    def emit(event: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(event), flush=True)
        elif event["event"] == "step":
            rate = event["tokens"] / max(event["step_seconds"], 1e-9)
            print(f"step {event['step']:>5}  loss {event['loss']:.4f}  epoch {event['epoch']}  "
                  f"{event['layout']}  {event['step_seconds'] * 1000:.0f} ms  "
                  f"{rate:,.0f} tokens/s", flush=True)  # fmt: skip
        elif event["event"] == "lost":
            print(f"== member {event['member']} died (exit code {event['exit_code']})", flush=True)
        elif event["event"] == "broken":
            print(f"   {event['member']}: world broke at step {event['step']}: {event['reason']}",
                  flush=True)  # fmt: skip
        elif event["event"] == "switch":
            print(f"== switch at step {event['step']}: {event['from']} -> {event['to']}: "
                  f"{event['result']}, pause {event['pause_seconds']:.3f} s, prepared in "
                  f"{event['prepare_seconds']:.2f} s, {event['network_bytes'] / 1e6:.1f} MB "
                  f"moved{'' if event['result'] == 'committed' else ': ' + event['reason']}",
                  flush=True)  # fmt: skip
        elif event["event"] == "checkpoint":
            print(f"== checkpoint at step {event['step']} to {event['path']} in "
                  f"{event['seconds']:.2f} s", flush=True)  # fmt: skip

    return emit


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liveshard-local", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a preset name or a JSON/YAML model file")
    parser.add_argument("--nprocs", type=int, default=4, help="members at the start")
    parser.add_argument("--layout", help="the first layout (default dp=NPROCS)")
    parser.add_argument("--switch", action="append", default=[], metavar="STEP:LAYOUT",
                        help="switch to LAYOUT at step STEP (repeatable)")  # fmt: skip
    parser.add_argument("--kill", action="append", default=[], metavar="STEP:RANK",
                        help="the member at RANK kills its process as it begins step STEP "
                             "(repeatable): the job recovers from surviving copies")  # fmt: skip
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
    add_training_flags(parser, defaults={"steps": 60})
    return parser


def job_from_args(args: argparse.Namespace) -> LocalJob:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layout = parse_degrees(args.layout) if args.layout else Degrees(dp=args.nprocs)
    config = local_config(
        args.model, training_from_flags(args), device=device, precision=args.precision,
        budget=parse_bytes(args.budget),
    )  # fmt: skip
    return LocalJob(
        config=config, nprocs=args.nprocs, layout=layout,
        switches=tuple(parse_switch(s) for s in args.switch), checksums=args.checksums,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, kills=tuple(parse_kill(k) for k in args.kill),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        job = job_from_args(args)
        Driver(job, _printer(args.json or not sys.stdout.isatty())).run()
    except InvalidInput as err:
        print(f"liveshard-local: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
