"""A member says a change is prepared in the step during which its prepare ended: its readiness
is read just before the step's last all-reduce, not as the step begins. Two gloo processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

from liveshard_core.layout.layout import parse_degrees
from liveshard_e2e.workers import Pool


@pytest.fixture
def pool() -> Iterator[Pool]:
    workers = Pool(2, "tests.agent.runtime.readiness_tasks", threads=1)
    yield workers
    workers.close()


@pytest.mark.parametrize(("old", "new"), [("dp=2", "tp=2"), ("tp=2", "pp=2")])
def test_a_change_prepared_during_a_step_switches_at_its_end(
    pool: Pool, old: str, new: str
) -> None:
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    members = ["m0", "m1"]
    started = pool.run(
        {i: ("start", dict(index=i, port=store.port, layout=old, members=members))
         for i in range(2)}
    )  # fmt: skip
    assert started == {0: 1, 1: 1}
    # Taken at the boundary of step 1, the change's prepare runs during step 1 and ends before
    # its update: every member says so in that step's all-reduce, and all switch at its end.
    for out in pool.all("prepare_during_a_step", layout=new):
        assert out["stepped"] == 1 and out["results"] == [("committed", 2)], out
        degrees = parse_degrees(new)
        assert (out["degrees"], out["step"]) == ((degrees.dp, degrees.tp, degrees.pp), 2)
