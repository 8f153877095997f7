"""Argument parsing and printing shared by the `liveshard` subcommands."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import InvalidInput

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20,
          "gi": 2**30, "ti": 2**40}  # fmt: skip

T = TypeVar("T")


def parse_bytes(text: str, what: str = "budget") -> int:
    """`1073741824`, `1GiB`, `512MiB`, `2GB`: a positive number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match or int(match[1]) < 1:
        raise InvalidInput(
            f"{what} {text!r} is not a positive size like 1073741824, 512MiB or 2GiB"
        )
    return int(match[1]) * _UNITS[match[2] or ""]


def parse_rate(text: str, what: str = "bandwidth") -> float:
    """`25GB/s`, `12.5GB/s`, `100Gbit/s`, `3e9`: a positive number of bytes per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgt]i?)?(b|bit)?(?:/s)?\s*",
                         text.lower())  # fmt: skip
    value = float(match[1]) * _UNITS[match[2] or ""] if match else 0.0
    if match and match[3] == "bit":
        value /= 8
    if not value > 0:
        raise InvalidInput(f"{what} {text!r} is not a positive rate like 25GB/s or 100Gbit/s")
    return value


def parse_seconds(text: str, what: str) -> float:
    """`0.001`, `1ms`, `50us`, `2s`: a number of seconds >= 0."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e-?\d+)?)\s*(s|ms|us)?\s*", text.lower())
    if not match:
        raise InvalidInput(f"{what} {text!r} is not a duration like 0.001, 1ms or 50us")
    return float(match[1]) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[match[2] or "s"]


def int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidInput(f"{flag} {text!r} must be comma-separated member numbers") from None


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def print_human(summary: dict[str, Any]) -> None:
    """One `key: value` line per field; long lists and pieces are summarised."""
    for key, value in summary.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            value = f"{len(value)} pieces"
        elif isinstance(value, dict) and len(value) > 8:
            value = f"{len(value)} entries, max {max(value.values())}"
        elif isinstance(value, list) and len(value) > 8:
            shown = [str(v) for v in value]
            value = f"{len(value)} entries: {', '.join(shown[:4])}, ..., {shown[-1]}"
        elif isinstance(value, list):
            value = ", ".join(str(v) for v in value) or "none"
        print(f"{key}: {value}")
