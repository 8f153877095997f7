"""The status a board's snapshot sends: a pending epoch shows a drop queued for it."""

from __future__ import annotations

from liveshard_agent.server.status import (
    Claim,
    ClaimKind,
    Observed,
    PendingState,
    PendingView,
    Snapshot,
)


def test_a_pending_epoch_shows_a_drop_queued_for_it_until_the_loop_takes_it() -> None:
    pending = PendingView(3, PendingState.PREPARED, at_step=-1)
    observed = Observed(training=True, epoch=2, pending=pending)

    def dropping(*claims: Claim) -> bool:
        status = Snapshot("m0", steps=10, observed=observed, claims=claims).to_proto()
        assert status.pending.epoch == 3
        return status.pending.dropping

    assert not dropping()
    assert not dropping(Claim(1, ClaimKind.DROP, number=2))  # an earlier epoch's drop
    assert not dropping(Claim(1, ClaimKind.SWITCH, number=3, at_step=5))
    assert dropping(Claim(2, ClaimKind.DROP, number=3))
