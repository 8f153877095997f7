"""The control bench's simulated member against a real c10d store: a change given up whose store
its host freed fails the member's pending change (as a real member's connect to it would), so
the member drops it when told, rather than ending its loop on the store's error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from liveshard_agent.engine.world import StoreAddress, connect_store, host_store
from liveshard_agent.runtime.change import Change
from liveshard_core.job import Deadlines, Result, TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from liveshard_core.vps.presets import preset

ROOT = Path(__file__).resolve().parents[2]


def test_a_simulated_member_fails_a_change_whose_store_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import control_agents

    spec = preset("tiny")
    old = parse_degrees("dp=2").layout(spec, ["a", "b"])
    new = parse_degrees("dp=1").layout(spec, ["a"])
    host = host_store(StoreAddress("127.0.0.1", 0), 5.0)
    member = control_agents.SimMember("b", TrainingSettings(), Deadlines(), 0.05, time.time())
    member.use_store(connect_store(StoreAddress("127.0.0.1", host.port), 5.0))
    member.start(old)
    member.request(Change(epoch=1, old=old, new=new))
    assert member.at_boundary() == []  # said it is prepared; waits for the other member
    assert member.pending is not None and member.pending.future.exception() is None

    del host  # the host dropped the change given up: its store is freed
    assert member.at_boundary() == []  # no raise: the loop goes on
    failed = member.pending.future.exception()
    assert failed is not None and "the change's store is gone" in str(failed)
    assert member.at_boundary() == []  # and no more round trips to it
    dropped = member.drop(1, "dropped on request")
    assert dropped.result is Result.ABORTED and member.pending is None
