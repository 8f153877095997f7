"""A local member's process: the member's loop, fed by the driver's commands over a pipe, its
events sent back over the same pipe.

The driver (`launcher.Driver`) spawns one such process per member (`member_main`). The commands
arrive as the runtime's `loop.Command` values; what goes back is the runtime's events themselves
(`runtime.events`, which pickle), sent only where the driver has a use for them: steps from the
world's rank 0 (and every member's, when the job records samples), the checkpoints rank 0
reports, and every switch, broken world, end of the job and refused command; or `Crashed` when
the process fails. This module must not print: the driver does.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import cast

import torch

from ..data.builtin import job_model
from ..engine.world import wait_closed
from ..runtime.events import Checkpointed, CheckpointFailed, Event, Report, Stepped
from ..runtime.loop import Command, Prepare, run_member
from ..runtime.member import Member
from .faults import Faults, combine
from .job import JOB_NAME, LocalJob


@dataclass(frozen=True)
class Crashed:
    """The member's process failed (the error and its traceback): the job cannot go on."""

    message: str


class _PipeInbox:
    """The driver's commands, from the member's end of its pipe (the scripted faults see each
    change asked for)."""

    def __init__(self, conn: Connection, faults: Faults) -> None:
        self.conn, self.faults = conn, faults

    def get(self, timeout: float | None) -> Command | None:
        if not self.conn.poll(timeout):
            return None
        command = cast(Command, self.conn.recv())
        if isinstance(command, Prepare):
            self.faults.seen(command.change)
        return command


def member_main(name: str, index: int, job: LocalJob, conn: Connection) -> None:
    """The process of member `name`, the `index`-th started (which picks its GPU)."""
    try:
        torch.set_num_threads(1)
        device = (
            torch.device("cuda", index % torch.cuda.device_count())
            if job.device == "cuda"
            else torch.device("cpu")
        )
        faults = Faults(name, job.kills)
        hooks = combine(job.hooks(name) if job.hooks is not None else None, faults.hooks())
        member = Member(
            name=name, spec=job.spec(), settings=job.settings, device=device,
            deadlines=job.deadlines, job=JOB_NAME, checksums=job.checksums, hooks=hooks,
            hf=job_model(job.config), pretrained=job.config.pretrained, seal=job.seal(),
        )  # fmt: skip
        faults.member = member
        run_member(
            member,
            _PipeInbox(conn, faults),
            _reporter(job, conn),
            _before_step(job, faults),
            faults.after_update,
        )
        wait_closed(30)  # groups closing in the background end before the process does
    except BaseException as err:
        conn.send(Crashed(f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        return
    # A change still preparing when the job ended (dropped, its thread in a store or a group's
    # connect) would be torn down with the interpreter, and torch aborts the process there; the
    # member has trained its last step and said all it had to: nothing is left to tear down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reporter(job: LocalJob, conn: Connection) -> Report:
    """Sends the driver the events it uses: steps from the world's rank 0 (every member's with
    `record_samples`), checkpoints (saved or failed) as reported by rank 0, everything else."""

    def report(event: Event) -> None:
        match event:
            case Stepped(speaks=speaks, record=record):
                if speaks or (job.record_samples and record.samples):
                    conn.send(event)
            case Checkpointed(report=True) | CheckpointFailed(report=True):
                conn.send(event)
            case Checkpointed() | CheckpointFailed():
                pass
            case _:
                conn.send(event)

    return report


def _before_step(job: LocalJob, faults: Faults) -> Callable[[Member], None]:
    """`--checkpoint-every N`: every member asks for a checkpoint after each N-th step; `--kill
    STEP:RANK`: the member at RANK dies as it begins step STEP (`faults`)."""
    every, directory = job.checkpoint_every, job.checkpoint_dir
    kill = faults.before_step

    def before_step(member: Member) -> None:
        after = member.step + 1
        if every and after % every == 0:
            assert directory is not None
            path = os.path.join(directory, f"step-{after}")
            member.request_checkpoint(after // every, path, at_step=after)
        kill(member)

    return before_step
