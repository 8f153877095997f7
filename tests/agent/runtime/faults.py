"""Switch hooks the training tests install in member processes (`LocalJob.hooks`).

A job goes to every member's process when it is spawned, so its hooks factory must pickle: a
function of this module, or a `functools.partial` of one.
"""

from __future__ import annotations

from liveshard_agent.engine.switch import SwitchHooks


def votes_no(refusing: str, member: str) -> SwitchHooks:
    """Member `refusing` votes no in every switch; the others vote as usual (install it as
    `functools.partial(votes_no, "w1")`)."""

    def refuse() -> None:
        raise RuntimeError(f"{refusing} refuses (injected by the test)")

    return SwitchHooks(before_vote=refuse) if member == refusing else SwitchHooks()
