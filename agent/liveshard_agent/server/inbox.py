"""The thread-safe inbox between the gRPC handlers and the member's loop, with each command's
outcome.

Handlers `put` commands (from any thread) and get a `Ticket`; the loop takes them in order with
`get` (on its own thread, as `runtime.loop.Inbox`). The loop obeys a command before it asks for
the next one and reports a refusal as an `error` event while obeying it, so a ticket is settled
when the loop next calls `get`: refused if an error was reported meanwhile, done otherwise.
`get` is also the loop's heartbeat: it calls `on_boundary` (on the loop's thread, where reading
the member is safe) with the tickets settled there, before handing out the next command. This
module must not know what the commands mean.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..runtime.loop import Command


@dataclass
class Ticket:
    """One accepted command and, once the loop has obeyed it, its outcome."""

    number: int
    command: Command
    before: Callable[[], None] | None = None  # runs on the loop's thread as the loop takes it
    error: str | None = None  # the member's refusal
    taken: bool = False
    settled: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float) -> bool:
        """Whether the loop obeyed the command within `timeout` seconds."""
        return self.settled.wait(timeout)


class CommandInbox:
    def __init__(self, on_boundary: Callable[[list[Ticket]], None]) -> None:
        self._queue: queue.Queue[Ticket] = queue.Queue()
        self._numbers = itertools.count(1)
        self._current: Ticket | None = None
        self._on_boundary = on_boundary

    def put(
        self,
        command: Command,
        before: Callable[[], None] | None = None,
        shown: Callable[[Ticket], None] | None = None,
    ) -> Ticket:
        """Queue `command`; `shown` runs with its ticket before the loop can take it, so what the
        caller records of the ticket there (the status's claim) is never behind its settling."""
        ticket = Ticket(next(self._numbers), command, before)
        if shown is not None:
            shown(ticket)
        self._queue.put(ticket)
        return ticket

    def refuse_current(self, message: str) -> None:
        """The loop reported that the command it is obeying was refused (loop thread)."""
        if self._current is not None:
            self._current.error = message

    def get(self, timeout: float | None) -> Command | None:
        settled = [self._current] if self._current is not None else []
        self._current = None
        self._on_boundary(settled)
        for ticket in settled:  # after the status shows the outcome, so waiters see it there
            ticket.settled.set()
        try:
            ticket = self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        ticket.taken = True
        if ticket.before is not None:
            ticket.before()
        self._current = ticket
        return ticket.command
