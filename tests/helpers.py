"""Helpers shared by every test package."""

from __future__ import annotations

from typing import Any


def names(n: int, prefix: str = "m", start: int = 0) -> list[str]:
    """Member names `m0, m1, ...` (or another prefix), starting at `start`."""
    return [f"{prefix}{i}" for i in range(start, start + n)]


def number(member: str) -> int:
    """The number of a member named by `names`: `m3` -> 3."""
    return int(member.lstrip("abcdefghijklmnopqrstuvwxyz"))


class OnePod:
    """The API server's answer to the operator's reads (`observe`): the one pod `body`, on no
    leaving node."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def nodes(self) -> list[dict[str, Any]]:
        return []

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [self.body]


def pod_body(name: str, members: int, ip: str) -> dict[str, Any]:
    """A running worker pod of `members` members at `ip`, as the API server lists it."""
    from liveshard_operator.render import MEMBERS_ANNOTATION

    return {
        "metadata": {"name": name, "annotations": {MEMBERS_ANNOTATION: str(members)}},
        "spec": {"containers": [{"name": "agent"}]},
        "status": {"podIP": ip, "phase": "Running"},
    }
