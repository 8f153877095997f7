"""`liveshard-local --kill STEP:RANK`: a member that dies without notice, at a known point.

The member at RANK of the layout in effect kills its own process (SIGKILL) as it begins step
STEP, so that a failure without notice can be shown and tried: the survivors' world breaks and
the launcher answers with a recovery, as the operator does on Kubernetes. This module is the
whole of that harness: the flag's value (`ScriptedKill`) and the member's part (`kill_at`, run
before each step by the member's process). The driver, the runtime and the engine know nothing
of it; tests inject their own faults through `LocalJob.hooks` instead.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from liveshard_core.errors import InvalidInput

from ..engine import keys
from ..runtime.member import Member


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


def kill_at(kills: tuple[ScriptedKill, ...]) -> Callable[[Member], None]:
    """What a member runs before each step: it dies if a kill names this step and its rank."""

    def before_step(member: Member) -> None:
        assert member.layout is not None
        rank = member.layout.rank_of(member.name)
        for kill in kills:
            # Once per job: the recovery resumes at this step, maybe with another member at RANK.
            once = keys.kill(kill.step, kill.rank)
            if (kill.step, kill.rank) == (member.step, rank) and member.store.add(once, 1) == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    return before_step
