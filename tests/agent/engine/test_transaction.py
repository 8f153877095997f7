"""Single-process tests of the reconfiguration transaction: phases, epochs, deadlines, records.

A member that switches with itself (the same one-member layout before and after) runs the whole
transaction in one process: plan, digest agreement, a one-member union group (gloo), the vote.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="the transfer engine needs torch (the agent extra)")

from torch.distributed import HashStore, TCPStore  # noqa: E402

from liveshard_agent.engine.errors import (  # noqa: E402
    Cause,
    EpochReused,
    PhaseError,
    PlanMismatch,
    PrepareTimeout,
    TransferError,
)
from liveshard_agent.engine.state import ShardedState  # noqa: E402
from liveshard_agent.engine.switch import Phase, Reconfiguration, SwitchHooks  # noqa: E402
from liveshard_core.errors import InvalidInput, PermanentError, RetryableError  # noqa: E402
from liveshard_core.job import Deadlines  # noqa: E402
from liveshard_core.layout.layout import Layout  # noqa: E402
from liveshard_core.vps.presets import preset  # noqa: E402

CPU = torch.device("cpu")
TINY = preset("tiny")
SOLO = Layout.create(TINY, ["m0"])


def solo(store: HashStore, epoch: int, **kwargs: object) -> Reconfiguration:
    options = {"deadlines": Deadlines(2, 5, 10), **kwargs}
    return Reconfiguration(
        spec=TINY, old=SOLO, new=SOLO, member="m0", store=store, epoch=epoch, device=CPU,
        budget=1 << 20, job="unit", **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_phases_are_checked_on_every_call() -> None:
    store = HashStore()
    reconfig = solo(store, 1)
    assert reconfig.phase is Phase.CREATED
    state = ShardedState.seeded(TINY, SOLO, 0, 3, CPU)
    with pytest.raises(PhaseError, match="cannot go to switching from created"):
        reconfig.switch(state)
    reconfig.prepare()
    assert reconfig.phase is Phase.PREPARED
    with pytest.raises(PhaseError, match="from prepared"):
        reconfig.prepare()
    result = reconfig.switch(state)
    assert result.committed and result.cause is None
    assert reconfig.phase is Phase.COMMITTED
    assert result.state is not None and result.state.matches_seed(3) == []
    assert state.released
    with pytest.raises(PhaseError):
        reconfig.switch(result.state)


def test_an_epoch_is_refused_the_second_time_before_anything_else() -> None:
    store = HashStore()
    solo(store, 7).prepare()
    again = solo(store, 7)
    with pytest.raises(EpochReused, match="epoch 7 was already used by m0"):
        again.prepare()
    assert again.phase is Phase.FAILED
    assert again.part is None  # refused before planning
    solo(store, 8).prepare()  # the next epoch is fine


def test_abort_of_a_prepared_reconfiguration_drops_what_prepare_built() -> None:
    reconfig = solo(HashStore(), 1)
    reconfig.prepare()
    shadow = reconfig.shadow
    assert shadow is not None and shadow.nbytes > 0
    reconfig.abort()
    assert reconfig.phase is Phase.ABORTED
    assert shadow.released and reconfig.union is None and reconfig.world is None
    with pytest.raises(PhaseError):
        reconfig.switch(ShardedState.seeded(TINY, SOLO, 0, 3, CPU))


def test_prepare_is_bounded_by_its_deadline() -> None:
    # m1 never comes: the digest agreement cannot finish.
    old = Layout.create(TINY, ["m0"])
    new = Layout.create(TINY, ["m0", "m1"], dp=2)
    reconfig = Reconfiguration(
        spec=TINY, old=old, new=new, member="m0", store=HashStore(), epoch=1, device=CPU,
        budget=1 << 20, deadlines=Deadlines(0.5, 1, 1.5),
    )  # fmt: skip
    start = time.monotonic()
    future = reconfig.prepare_in_background()
    with pytest.raises(PrepareTimeout) as err:
        future.result(timeout=30)
    assert time.monotonic() - start < 10
    assert err.value.cause is Cause.DEADLINE_PASSED
    assert "['m1']" in str(err.value) or "deadline" in str(err.value)
    assert reconfig.phase is Phase.FAILED


def test_vote_no_from_a_hook_aborts_and_keeps_the_old_state() -> None:
    def refuse() -> None:
        raise RuntimeError("not today")

    reconfig = solo(HashStore(), 1, hooks=SwitchHooks(before_vote=refuse))
    reconfig.prepare()
    state = ShardedState.seeded(TINY, SOLO, 0, 3, CPU)
    result = reconfig.switch(state)
    assert not result.committed
    assert result.cause is Cause.VOTE_NO
    assert "not today" in result.reason
    assert result.state is state and not state.released and state.matches_seed(3) == []
    assert reconfig.phase is Phase.ABORTED


def store_in_a_process() -> tuple[subprocess.Popen[str], TCPStore]:
    """A c10d store served by a process of its own, which a test can kill, and a client."""
    serve = (
        "import time; from torch.distributed import TCPStore; "
        "s = TCPStore('127.0.0.1', 0, None, True); print(s.port, flush=True); time.sleep(600)"
    )
    host = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    port = int(host.stdout.readline())
    return host, TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))


@pytest.mark.parametrize("commit", [True, False], ids=["told commit", "told abort"])
def test_a_member_whose_store_dies_before_it_reads_the_decision_is_undecided_until_told(
    commit: bool,
) -> None:
    # The store's host dies after the vote: this member voted yes, and a commit may have been
    # recorded and read by others; it keeps both states whole and ends as it is told.
    host, store = store_in_a_process()

    def kill_the_host() -> None:
        host.kill()
        host.wait()

    reconfig = solo(store, 1, hooks=SwitchHooks(before_decision=kill_the_host))
    reconfig.prepare()
    state = ShardedState.seeded(TINY, SOLO, 0, 3, CPU)
    result = reconfig.switch(state)
    assert result.undecided and not result.committed and reconfig.phase is Phase.UNDECIDED
    assert result.cause is Cause.VOTE_INCOMPLETE and "store failed" in result.reason
    assert result.state is None and not state.released and state.matches_seed(3) == []
    with pytest.raises(PhaseError, match="from undecided"):
        reconfig.switch(state)
    told = reconfig.resolve(commit, "no member read a commit")
    assert told.committed is commit and not told.undecided
    if commit:
        assert reconfig.phase is Phase.COMMITTED and state.released
        assert told.state is not None and told.state.matches_seed(3) == []
        assert told.world is not None
    else:
        assert reconfig.phase is Phase.ABORTED and "aborted as told" in told.reason
        assert told.state is state and state.matches_seed(3) == []
    with pytest.raises(PhaseError, match=r"from (committed|aborted)"):
        reconfig.resolve(commit)


def test_a_member_that_voted_no_aborts_alone_when_its_store_dies() -> None:
    # No commit can have been recorded anywhere: it need not be told.
    host, store = store_in_a_process()

    def refuse() -> None:
        raise RuntimeError("not today")

    def kill_the_host() -> None:
        host.kill()
        host.wait()

    hooks = SwitchHooks(before_vote=refuse, before_decision=kill_the_host)
    reconfig = solo(store, 1, hooks=hooks)
    reconfig.prepare()
    state = ShardedState.seeded(TINY, SOLO, 0, 3, CPU)
    result = reconfig.switch(state)
    assert not result.undecided and not result.committed and result.cause is Cause.VOTE_NO
    assert result.state is state and state.matches_seed(3) == []
    assert reconfig.phase is Phase.ABORTED


def test_every_line_carries_the_context_and_the_switch_ends_with_one_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="liveshard_agent")
    reconfig = solo(HashStore(), 4)
    reconfig.prepare()
    result = reconfig.switch(ShardedState.seeded(TINY, SOLO, 0, 3, CPU))
    ours = [r for r in caplog.records if r.name.startswith("liveshard_agent.engine")]
    assert ours and all(
        (r.job, r.epoch, r.member) == ("unit", 4, "m0")  # type: ignore[attr-defined]
        for r in ours
    )
    assert all(r.getMessage().startswith("[job=unit epoch=4 member=m0] ") for r in ours)
    records = [r for r in ours if "switch {" in r.getMessage()]
    assert len(records) == 1
    record = result.record
    assert (record.result, record.epoch, record.member) == ("committed", 4, "m0")
    assert record.local_bytes == TINY.state_bytes  # a member that keeps everything copies it
    assert record.sent_bytes == record.received_bytes == 0
    assert set(record.seconds) >= {"plan", "groups", "shadow", "transfer", "vote", "pause"}
    assert record.to_json() in records[0].getMessage()


def test_errors_are_permanent_or_retryable() -> None:
    assert issubclass(PlanMismatch, PermanentError)
    assert issubclass(EpochReused, PermanentError)
    assert issubclass(PhaseError, PermanentError)
    assert issubclass(TransferError, RetryableError)
    assert issubclass(PrepareTimeout, RetryableError)
    assert issubclass(InvalidInput, PermanentError) and issubclass(InvalidInput, ValueError)
    with pytest.raises(InvalidInput):
        Layout.create(TINY, ["a"], tp=3)
