"""The agents of `bench/control.py`: real agent servers around a member that trains nothing.

Each agent is what `liveshard_agent.server.process.serve` builds from its pod's environment (the
gRPC API over mutual TLS with the job's token, the status board, the command inbox, the member's
loop `run_member`, a c10d store hosted when asked), with a `SimMember` in place of the `Member`.
A `SimMember` takes `step_seconds` per step on a clock every member shares (so members of one
world are at the same step at the same time), is prepared as soon as it is asked (or fails to
be, once told to: `FAIL`), and agrees on the switch step with the other members of a change
through the change's c10d store, as real members agree in their step's all-reduce: each says it
is prepared, and the first to see all of them prepared records the step two steps ahead, at
which every member switches.

A pod of several members (LIVESHARD_POD_MEMBERS from 2) is what `liveshard_agent.server.pod`
makes of it (its `Front`): an agent per member on its Unix socket, behind the pod's proxy on the
pod's address (mutual TLS, the calls forwarded unparsed, GetPodStatus answered with every
member's status); here they are threads of the farm, not processes.

`serve_farm` runs in a process of its own, fed over a pipe: ("start", name, environ) starts a
pod's agents and answers ("ready", name) or ("failed", name, why); ("stop", name) stops one (its
pod was deleted); ("agreed",) answers `AGREED`, `OBEYED`, `DROPPED` and `TOOK`; ("fail",
member) makes that member's next Prepare fail; ("quit",) ends the farm. On SIGUSR1 it writes the
stacks of all its threads, named, to the file it was given (`write_stacks`): what a change that
does not end shows of its agents. (faulthandler's dump stops at 100 threads; a farm runs thousands.)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from torch.distributed import DistError, Store, TCPStore

from liveshard_agent.engine.world import StoreAddress, host_store
from liveshard_agent.runtime.change import HELD, Change
from liveshard_agent.runtime.events import Checkpointed, CheckpointFailed, Switched, Undecided
from liveshard_agent.runtime.loop import run_member
from liveshard_agent.runtime.member import Member
from liveshard_agent.runtime.trainer import Scalars, StepRecord
from liveshard_agent.server.certs import ServingCertificate
from liveshard_agent.server.config import load
from liveshard_agent.server.inbox import CommandInbox
from liveshard_agent.server.pod import Front
from liveshard_agent.server.reporter import Reporter, observe
from liveshard_agent.server.requests import Job
from liveshard_agent.server.rpc import start_server
from liveshard_agent.server.service import AgentService
from liveshard_agent.server.status import Snapshot, StatusBoard
from liveshard_core.job import Deadlines, Result, TrainingSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.plan.union import union_members
from liveshard_core.vps.spec import ModelSpec

PREFIX = "sim"  # the keys a change's members agree on, in its store
# By epoch: when its last member said it was prepared (as the member that recorded the switch
# step saw it) and when the switch step begins, both wall-clock seconds. What lies between is the
# wait for the step boundary, which is no control overhead.
AGREED: dict[int, tuple[float, float]] = {}
# By epoch: when the last of this farm's members took its Prepare at a step boundary (wall-clock).
OBEYED: dict[int, float] = {}
# By epoch: how many of this farm's members dropped it, and when the last did (wall-clock).
DROPPED: dict[int, tuple[int, float]] = {}
# By epoch: how many of this farm's members took its Prepare (one that never did has none to drop).
TOOK: Counter[int] = Counter()
_COUNTING = threading.Lock()  # the farm's members count in threads of their own
# The members whose next Prepare fails (told by ("fail", member)): a change the operator aborts.
FAIL: set[str] = set()


@dataclass
class _Trainer:
    """What the member's loop and reporter read of a trainer."""

    layout: Layout
    scalars: Scalars

    def held_bytes(self) -> tuple[int, int]:
        return 0, 0  # it holds no state


@dataclass
class _Pending:
    change: Change
    future: Future[None]
    requested: float
    said_ready: bool = False
    undecided: None = None  # a simulated member always reads its switch's decision


class SimMember(Member):
    """A member that trains nothing: see the module's docstring. It keeps `Member`'s view of
    its state (its properties read the attributes set here) and replaces everything that
    trains, prepares or switches; `Member.__init__`, which builds the dataset, is not run."""

    def __init__(self, name: str, settings: TrainingSettings, deadlines: Deadlines,
                 step_seconds: float, clock_zero: float) -> None:  # fmt: skip
        self.name, self.settings, self.deadlines = name, settings, deadlines
        self.step_seconds, self.clock_zero = step_seconds, clock_zero
        self.trainer: _Trainer | None = None  # type: ignore[assignment]
        self.epoch = -1
        self.pending: _Pending | None = None  # type: ignore[assignment]
        self.checkpoint_due = None
        self.last_loss: float | None = None
        self.last_exchange_seconds = 0.0  # it trains nothing, so it has no peers' gradients
        self.broken = None
        self._store: Store | None = None
        self.zero = 0  # the tick of the job's step 0

    # ---- the clock ----

    def _tick(self) -> int:
        return int((time.time() - self.clock_zero) / self.step_seconds)

    def _wait_tick(self, tick: int) -> None:
        delay = self.clock_zero + tick * self.step_seconds - time.time()
        if delay > 0:
            time.sleep(delay)

    # ---- commands ----

    def start(self, layout: Layout, epoch: int = 0, scalars: Scalars | None = None) -> None:
        # The first world's step 0 is the tick after the first member came (so all of them
        # are at step s on tick `zero + s`).
        zero = self._agreed(f"{PREFIX}/{epoch}/zero", self._tick() + 2)
        self.trainer = _Trainer(layout, scalars or Scalars(seed=self.settings.seed))
        self.zero, self.epoch = zero, epoch

    def restore(self, layout: Layout, directory: str, epoch: int = 0) -> None:
        raise RuntimeError("the simulated member keeps no checkpoints")

    def request(self, change: Change) -> list[Switched]:
        future: Future[None] = Future()
        if self.name in FAIL:
            FAIL.discard(self.name)
            future.set_exception(RuntimeError(f"{self.name} was told to fail this Prepare"))
        else:
            future.set_result(None)  # prepared at once: no plan, no groups, no memory
        with _COUNTING:
            OBEYED[change.epoch] = max(OBEYED.get(change.epoch, 0.0), time.time())
            TOOK[change.epoch] += 1
        self.pending = _Pending(change, future, time.perf_counter())
        return []

    def set_switch_step(self, epoch: int, at_step: int) -> None:
        if self.pending is not None and self.pending.change.epoch == epoch:
            self.pending.change = replace(self.pending.change, at_step=at_step)

    def drop(self, epoch: int, reason: str = "", cause: Any = None) -> Switched:
        pending = self.pending
        assert pending is not None and pending.change.epoch == epoch
        self.pending = None
        with _COUNTING:
            count, _ = DROPPED.get(epoch, (0, 0.0))
            DROPPED[epoch] = (count + 1, time.time())
        return self._settled(pending, Result.ABORTED, reason or f"epoch {epoch} dropped")

    def request_checkpoint(self, *_: Any) -> None:
        raise RuntimeError("the simulated member keeps no checkpoints")

    def abandon(self) -> None:
        self.pending = None

    def at_end(self) -> None:
        return None

    def break_world(self, error: BaseException) -> Any:
        raise error  # no collectives: nothing breaks

    # ---- training ----

    def train_step(self, stepped: Callable[[StepRecord], None] | None = None) -> StepRecord:
        trainer = self.trainer
        assert trainer is not None
        step = trainer.scalars.step
        start = time.perf_counter()
        self._wait_tick(self.zero + step + 1)
        trainer.scalars = trainer.scalars.advanced(self.settings.global_batch)
        self.last_loss = 1.0
        seconds = time.perf_counter() - start
        record = StepRecord(step=step, loss=1.0, aux_loss=0.0, grad_norm=0.0, lr=0.0,
                            seconds=seconds, samples=(), agreement=())  # fmt: skip
        if stepped is not None:
            stepped(record)
        return record

    def at_boundary(self) -> list[Switched | Undecided | Checkpointed | CheckpointFailed]:
        """Switch when every member of the pending change is prepared: at the step recorded
        by the first member to see it, two steps ahead. A change given up may have its store
        freed by its host's drop before this member's: its round trip there then fails, and so
        does the pending change (a member's loop would otherwise end on the error)."""
        pending = self.pending
        if pending is None or pending.future.exception() is not None:
            return []
        try:
            at = self._switch_step(pending)
        except DistError as err:  # the change's store is gone: its host dropped the change
            pending.future = Future()  # failed, as a real member's connect to it would be
            pending.future.set_exception(RuntimeError(f"the change's store is gone: {err}"))
            return []
        if at is None or self.step < at:
            return []
        return [self._take(pending)]

    def join(self) -> Switched | None:
        """A member of the new world only: switch once the step is recorded and reached."""
        pending = self.pending
        assert pending is not None
        at = self._switch_step(pending)
        if at is None:
            return None
        store = self.store
        zero = int(store.get(f"{PREFIX}/{pending.change.epoch}/zero"))
        self._wait_tick(zero + at)
        self.zero = zero
        self.trainer = _Trainer(pending.change.new, Scalars(step=at, seed=self.settings.seed))
        return self._take(pending)

    def _switch_step(self, pending: _Pending) -> int | None:
        store = self.store
        change = pending.change
        base = f"{PREFIX}/{change.epoch}"
        if not pending.said_ready:
            store.add(f"{base}/ready", 1)
            pending.said_ready = True
        if store.check([f"{base}/at"]):
            return int(store.get(f"{base}/at"))
        members = union_members(change.old, change.new, change.lost)
        if change.at_step == HELD or int(store.add(f"{base}/ready", 0)) < len(members):
            return None
        if self.trainer is None:
            return None  # a joining member waits for one of the old world to record it
        store.set(f"{base}/zero", str(self.zero))
        ready = time.time()
        at = self._agreed(f"{base}/at", max(self.step + 2, change.at_step))
        AGREED.setdefault(
            change.epoch, (ready, self.clock_zero + (self.zero + at) * self.step_seconds)
        )
        return at

    def _take(self, pending: _Pending) -> Switched:
        change = pending.change
        self.pending = None
        self.epoch = change.epoch
        if self.name not in change.new.ranks:
            self.trainer = None
        elif self.trainer is not None:
            self.trainer.layout = change.new
        return self._settled(pending, Result.COMMITTED, f"epoch {change.epoch}: committed")

    def _settled(self, pending: _Pending, result: Result, reason: str) -> Switched:
        change = pending.change
        return Switched(
            epoch=change.epoch, step=max(self.step, 0), from_layout=change.old.describe(),
            to_layout=change.new.describe(), result=result, cause=None, reason=reason,
            pause_seconds=0.0, prepare_seconds=0.0, network_bytes=0,
            report=self.speaks, lost=tuple(sorted(change.lost)),
        )  # fmt: skip

    def _agreed(self, key: str, mine: int) -> int:
        """The value first recorded at `key` in the store (`mine` if this member is first)."""
        store = self.store
        return int(store.compare_set(key, "", str(mine)))


class _LazyStore:
    """A store hosted on first use: the agent keeps a spare store started for the next epoch
    asked of it, and a thousand idle stores, each with its threads, would measure this
    machine's scheduler rather than the control plane."""

    def __init__(self, address: StoreAddress, timeout: float) -> None:
        self.address, self.timeout = address, timeout
        self._store: TCPStore | None = None

    @property
    def port(self) -> int:
        if self._store is None:
            self._store = host_store(self.address, self.timeout)
        return int(self._store.port)


class _Agent:
    """One pod's agent: its server and its member's loop, in a thread."""

    def __init__(self, environ: dict[str, str], specs: dict[str, ModelSpec],
                 step_seconds: float, clock_zero: float) -> None:  # fmt: skip
        config = load(environ, [])
        job_config = config.job_config
        key = environ["LIVESHARD_CONFIG"]
        if key not in specs:
            specs[key] = job_config.model_spec("cpu")
        member = SimMember(config.member, job_config.training, job_config.deadlines,
                           step_seconds, clock_zero)  # fmt: skip
        board = StatusBoard(Snapshot(member=config.member, steps=job_config.training.steps))
        layouts: dict[int, Layout] = {}
        reporter = Reporter(member, board, config.job, layouts.get)
        inbox = CommandInbox(reporter.boundary)
        serving = ServingCertificate(config.tls) if config.tls is not None else None
        self.service = AgentService(
            job=Job(config.member, specs[key], job_config.training, job_config.deadlines,
                    job_config.budget_bytes),
            job_name=config.job, pod_ip=config.pod_ip, board=board, inbox=inbox,
            layouts=layouts, use_deadlines=lambda _: None, host_store=_LazyStore,
            serving=serving,
        )  # fmt: skip
        self.server = start_server(self.service, config.token, config.address, serving)
        board.update(
            lambda s: replace(s, ready=True, observed=observe(member, s.observed, layouts.get))
        )
        self.board = board

        def run() -> None:
            try:
                run_member(member, inbox, reporter)
            except Exception as err:
                reporter.fail(f"{type(err).__name__}: {err}")

        self.thread = threading.Thread(target=run, name=f"member {config.member}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.board.close()
        self.server.stop(0)


class _Pod:
    """One pod: its lone agent, or its proxy in front of an agent per member."""

    def __init__(self, environ: dict[str, str], specs: dict[str, ModelSpec],
                 step_seconds: float, clock_zero: float) -> None:  # fmt: skip
        config = load(environ, [])
        self.front: Front | None = None
        self.server: Any = None
        if config.pod_members == 1:
            self.agents = [_Agent(environ, specs, step_seconds, clock_zero)]
            return
        self.front = Front(config, environ)
        self.agents = [_Agent(env, specs, step_seconds, clock_zero) for env in self.front.environs]
        self.server = self.front.serve()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0)
        for agent in self.agents:
            agent.stop()
        if self.front is not None:
            self.front.close()


def write_stacks(path: str) -> None:
    """The stack of every thread of this process, named, at `path` (whole once it is there)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    with open(f"{path}.part", "w") as out:
        for ident, frame in sys._current_frames().items():  # noqa: SLF001  # the one way
            out.write(f"Thread {names.get(ident, '?')!r} ({ident:#x}), most recent call last:\n")
            out.writelines(traceback.format_stack(frame))
            out.write("\n")
    os.replace(f"{path}.part", path)


def serve_farm(conn: Connection, step_seconds: float, clock_zero: float, stacks: str) -> None:
    """Serve the pods the operator asks for (see the module's docstring); SIGUSR1 writes the
    stacks of its threads to `stacks`."""
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGUSR1, lambda *_: write_stacks(stacks))
    pods: dict[str, _Pod] = {}
    specs: dict[str, ModelSpec] = {}
    while True:
        message = conn.recv()
        if message[0] == "quit":
            for pod in pods.values():
                pod.stop()
            return
        if message[0] == "agreed":
            with _COUNTING:
                counts = (dict(AGREED), dict(OBEYED), dict(DROPPED), dict(TOOK))
            conn.send(counts)
            continue
        if message[0] == "fail":
            FAIL.add(message[1])
            continue
        if message[0] == "stop":
            if message[1] in pods:
                pods.pop(message[1]).stop()
            continue
        _, name, environ = message
        try:
            pods[name] = _Pod(environ, specs, step_seconds, clock_zero)
        except Exception as err:
            conn.send(("failed", name, f"{type(err).__name__}: {err}"))
        else:
            conn.send(("ready", name))
