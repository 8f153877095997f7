"""Tasks of `test_readiness` inside worker processes (`liveshard_e2e.workers.Pool`), gloo, CPU: a
member of `tiny` whose change's prepare ends during a step, not before it."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from liveshard_agent.engine.switch import SwitchHooks
from liveshard_agent.local.job import local_config
from liveshard_agent.runtime.change import Change
from liveshard_agent.runtime.member import Member
from liveshard_agent.runtime.trainer import StepRecord
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees

CONTEXT: dict[str, Any] = {}
SETTINGS = TrainingSettings(steps=100)


def start(index: int, port: int, layout: str, members: list[str]) -> int:
    """Join the world of `layout` over `members` and train one step; the step reached."""
    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    spec = local_config("tiny", SETTINGS).model_spec("cpu")
    member = Member(name=members[index], spec=spec, settings=SETTINGS, store=store,
                    device=torch.device("cpu"))  # fmt: skip
    member.start(parse_degrees(layout).layout(spec, members))
    member.train_step()
    member.at_boundary()
    CONTEXT["member"] = member
    return member.step


def prepare_during_a_step(layout: str) -> dict[str, Any]:
    """Ask for the change to `layout` (at no set step: as soon as every member is prepared),
    whose prepare waits for the next step to begin and ends before that step's update; then
    train that one step. What its boundary did, and the degrees and step after it."""
    member: Member = CONTEXT["member"]
    trainer, old = member.trainer, member.layout
    assert trainer is not None and old is not None
    began = threading.Event()
    member.hooks = SwitchHooks(before_prepare=lambda: began.wait(60))
    original = trainer.step

    def step(agreement: Any, stepped: Any = None) -> StepRecord:
        began.set()
        assert member.pending is not None and not member.pending.future.done()
        member.pending.future.result(60)  # the prepare ends inside the step
        return original(agreement, stepped)

    trainer.step = step  # type: ignore[method-assign]
    new = parse_degrees(layout).layout(member.spec, list(old.members))
    member.request(Change(epoch=1, old=old, new=new, at_step=0))
    stepped = member.step
    member.train_step()
    events = member.at_boundary()
    now = member.layout
    assert now is not None
    return {
        "stepped": stepped,
        "results": [(e.result.value, e.step) for e in events],
        "degrees": (now.dp, now.tp, now.pp),
        "step": member.step,
    }
