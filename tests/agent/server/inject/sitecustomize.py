"""Loaded at start by an agent process whose PYTHONPATH names this folder (the server tests put
it there): faults the environment asks for are injected before the agent runs.

`TEST_LOSE_THE_DECISION=a0,a1` (or `*`: every member): in the agents of those members, the first
switch's decision cannot be recorded or read, as if the change's store's host died at that moment.
`TEST_SETTLE_BEFORE_ANSWERING=1`: every command is obeyed before the call that gave it goes on
(`faults.settle_before_answering`).
"""

import os

_MEMBER = os.environ.get("LIVESHARD_MEMBER", "")
_LOSING = os.environ.get("TEST_LOSE_THE_DECISION", "").split(",")
if _MEMBER and (_MEMBER in _LOSING or "*" in _LOSING):
    from tests.agent.runtime.faults import lose_the_first_decision

    lose_the_first_decision(_MEMBER)

if os.environ.get("TEST_SETTLE_BEFORE_ANSWERING"):
    from tests.agent.server.faults import settle_before_answering

    settle_before_answering()
