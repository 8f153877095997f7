"""Loaded at start by an agent process whose PYTHONPATH names this folder (the server tests put
it there): faults the environment asks for are injected before the agent runs.

`TEST_LOSE_THE_DECISION=a0,a1` (or `*`: every member): in the agents of those members, the first
switch's decision cannot be recorded or read, as if the change's store's host died at that moment.
"""

import os

_MEMBER = os.environ.get("LIVESHARD_MEMBER", "")
_LOSING = os.environ.get("TEST_LOSE_THE_DECISION", "").split(",")
if _MEMBER and (_MEMBER in _LOSING or "*" in _LOSING):
    from tests.agent.runtime.faults import lose_the_first_decision

    lose_the_first_decision(_MEMBER)
