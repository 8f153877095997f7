"""Helpers shared by every test package."""

from __future__ import annotations


def names(n: int, prefix: str = "m", start: int = 0) -> list[str]:
    """Member names `m0, m1, ...` (or another prefix), starting at `start`."""
    return [f"{prefix}{i}" for i in range(start, start + n)]


def number(member: str) -> int:
    """The number of a member named by `names`: `m3` -> 3."""
    return int(member.lstrip("abcdefghijklmnopqrstuvwxyz"))
