"""Switch hooks the training tests install in member processes (`LocalJob.hooks`)."""

from __future__ import annotations

from liveshard_agent.engine.switch import SwitchHooks


def w1_votes_no(member: str) -> SwitchHooks:
    """Member w1 votes no in every switch; the others vote as usual."""

    def refuse() -> None:
        raise RuntimeError("w1 refuses (injected by the test)")

    return SwitchHooks(before_vote=refuse) if member == "w1" else SwitchHooks()
