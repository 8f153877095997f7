"""A pool of worker processes for multi-process tests and benchmarks (dev only).

Each worker imports torch once and then runs tasks sent by the driver: functions of a task module
(the tests' or a benchmark's), called by name with keyword arguments. A task module keeps what a
worker needs between tasks in its own module-level state. A worker that dies is restarted and its
result is `Died`; a task that raises makes `run` raise `TaskFailed` with every failing worker's
traceback, after every worker has answered, so the next task starts in step.
"""

from __future__ import annotations

import importlib
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

from liveshard_agent.local.start import start_context


@dataclass(frozen=True)
class Died:
    """A worker that exited while running a task."""

    exitcode: int | None


class TaskFailed(AssertionError):
    """A task raised in one or more workers; the message holds their tracebacks."""


def _serve(conn: Connection, module_name: str, threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    module = importlib.import_module(module_name)
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(module, name)(**kwargs)))
        except BaseException as err:  # report every failure to the driver, then keep serving
            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


class Pool:
    """`size` workers serving the tasks of `tasks` (a module, or its importable name), each with
    `threads` torch threads (torch's default if None); a task's answer waits `timeout` seconds
    unless the call says otherwise."""

    def __init__(
        self,
        size: int,
        tasks: ModuleType | str,
        threads: int | None = None,
        timeout: float = 120,
    ) -> None:
        name = tasks if isinstance(tasks, str) else tasks.__name__
        # A script run as __main__ is re-imported by spawned processes as __mp_main__.
        self.module = "__mp_main__" if name == "__main__" else name
        self.threads = threads
        self.timeout = timeout
        self.ctx = start_context(["torch"])  # as liveshard-local's members
        self.workers: list[tuple[Any, Connection]] = [self._start() for _ in range(size)]

    def __len__(self) -> int:
        return len(self.workers)

    def _start(self) -> tuple[Any, Connection]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, self.module, self.threads), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def run(
        self, tasks: dict[int, tuple[str, dict[str, Any]]], timeout: float | None = None
    ) -> dict[int, Any]:
        """Run one task on each named worker at once; returns each worker's result (`Died` for a
        worker that died, which is restarted)."""
        for w, task in tasks.items():
            self.workers[w][1].send(task)
        results: dict[int, Any] = {}
        errors: list[str] = []
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for w in tasks:
            proc, conn = self.workers[w]
            while not conn.poll(0.05):
                if not proc.is_alive():
                    break
                if time.monotonic() > deadline:
                    raise TaskFailed(f"worker {w} did not answer within {timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:  # the worker died: its end of the pipe closed
                proc.join(5)
                results[w] = Died(proc.exitcode)
                self.workers[w] = self._start()
                continue
            if status == "error":
                errors.append(f"worker {w} failed: {value}")
            results[w] = value
        if errors:
            raise TaskFailed("\n".join(errors))
        return results

    def all(self, name: str, **kwargs: Any) -> list[Any]:
        """Run task `name` with the same arguments on every worker; results in worker order. A
        worker that dies fails the call."""
        out = self.run({w: (name, dict(kwargs)) for w in range(len(self))})
        died = {w: r for w, r in out.items() if isinstance(r, Died)}
        if died:
            raise TaskFailed(f"workers died in task {name}: {died}")
        return [out[w] for w in range(len(self))]

    def close(self) -> None:
        for proc, conn in self.workers:
            conn.close()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
