"""Switch hooks the training tests install in member processes (`LocalJob.hooks`), and faults
they inject there through the same factory (a checkpoint write that fails, files that cannot
grow).

A job goes to every member's process when it is spawned, so its hooks factory must pickle: a
function of this module, or a `functools.partial` of one.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import time
from typing import Any

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


def cannot_read_the_decision(losing: tuple[str, ...], late: float, member: str) -> SwitchHooks:
    """The members `losing` lose the change's store (its host died, as they see it) when they
    come to record or read the first switch's decision, `late` seconds after their vote."""
    if member not in losing:
        return SwitchHooks()

    def after_vote() -> None:
        time.sleep(late)
        lose_the_first_decision(member)

    return SwitchHooks(before_decision=after_vote)


def lose_the_first_decision(member: str) -> None:
    """From now on in this process, the first attempt to record or read a switch's decision
    fails as a call to a store whose host died fails; the store answers every later call (the
    next change's store is another)."""
    from liveshard_agent.engine.sealed import JobStore

    first = JobStore.first
    lost: list[str] = []

    def gone(self: JobStore, key: str, payload: str) -> str:
        if key.endswith("/decision") and not lost:
            lost.append(key)
            raise RuntimeError(f"Connection reset by peer ({member}'s store, injected)")
        return first(self, key, payload)

    JobStore.first = gone  # type: ignore[method-assign]


def slow_prepare(seconds: float, member: str) -> SwitchHooks:
    """Every member's prepare starts `seconds` late."""
    return SwitchHooks(before_prepare=lambda: time.sleep(seconds))


def cannot_write_once(failing: str, member: str) -> SwitchHooks:
    """Member `failing` cannot write its part of the first checkpoint (its disk is full, as DCP's
    writer sees it); the others write theirs, and every later checkpoint writes as usual (install
    it as `functools.partial(cannot_write_once, "w1")`)."""
    if member == failing:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write = FileSystemWriter.write_data
        calls = []

        def full(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.ENOSPC, f"No space left on device ({failing}, injected)")
            return write(self, *args, **kwargs)

        FileSystemWriter.write_data = full  # type: ignore[method-assign]
    return SwitchHooks()


def without_root(member: str) -> SwitchHooks:
    """Every member's process gives up root, if it has it, for the nobody user: file permissions
    then bind it as they bind any user (root writes into a read-only directory)."""
    if os.geteuid() == 0:
        nobody = 65534
        os.setgroups([])
        os.setresgid(nobody, nobody, nobody)
        os.setresuid(nobody, nobody, nobody)
    return SwitchHooks()


def cannot_grow_files(member: str) -> SwitchHooks:
    """Every member's process may write no byte to a file (its file size limit is 0, as `ulimit
    -f 0` sets it): the kernel refuses each write with EFBIG, as a full disk refuses it with
    ENOSPC, whoever runs the test, root included."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return SwitchHooks()
