"""Switch hooks the training tests install in member processes (`LocalJob.hooks`).

A job goes to every member's process when it is spawned, so its hooks factory must pickle: a
function of this module, or a `functools.partial` of one.
"""

from __future__ import annotations

import time

from liveshard_agent.engine.switch import SwitchHooks


def votes_no(refusing: str, member: str) -> SwitchHooks:
    """Member `refusing` votes no in every switch; the others vote as usual (install it as
    `functools.partial(votes_no, "w1")`)."""

    def refuse() -> None:
        raise RuntimeError(f"{refusing} refuses (injected by the test)")

    return SwitchHooks(before_vote=refuse) if member == refusing else SwitchHooks()


def loses_the_vote(loser: str, late: float, member: str) -> SwitchHooks:
    """Member `loser`'s view of the vote fails after the all-reduce completed (as when a member
    dies inside it and the all-reduce completes at some members only): it proposes an abort,
    `late` seconds after the others proposed their commit (or, with a negative `late`, the others
    propose `-late` seconds after it)."""

    def fail() -> None:
        time.sleep(max(late, 0))
        raise RuntimeError(f"{loser}'s all-reduce failed (injected by the test)")

    if member == loser:
        return SwitchHooks(before_decision=fail)
    return SwitchHooks(before_decision=lambda: time.sleep(max(-late, 0)))
