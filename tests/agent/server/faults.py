"""Faults the server tests inject into an agent process (through `inject/sitecustomize.py`)."""

from __future__ import annotations

from typing import Any

from liveshard_agent.runtime.loop import Command, Stop
from liveshard_agent.server.inbox import CommandInbox, Ticket

from .agents import WAIT


def settle_before_answering() -> None:
    """From now on in this process, a command the service puts in the member's inbox is obeyed
    (its ticket settled by the loop) before `put` returns, as when the handler's thread is kept
    off the CPU while the loop runs: whatever the handler does after `put` comes after the
    loop took and settled the command. A `Stop` is let through: the loop ends on it, unsettled."""
    put = CommandInbox.put

    def put_and_settle(self: CommandInbox, command: Command, *args: Any) -> Ticket:
        ticket = put(self, command, *args)
        if not isinstance(command, Stop) and not ticket.wait(WAIT):
            raise RuntimeError(f"{command} was not obeyed within {WAIT} s")
        return ticket

    CommandInbox.put = put_and_settle  # type: ignore[method-assign,assignment]
