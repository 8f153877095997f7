"""The training settings as command-line flags: one flag per `TrainingSettings` field, named
after it (`global_batch` -> `--global-batch`), typed, documented and (where the field lists them)
limited to its choices by the field itself. A list setting (`freeze`) is a repeatable flag, one
entry each, spelled as its `metavar` metadata shows (`--freeze 20:2 --freeze 40:4`)."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any

from ..errors import InvalidInput
from .settings import TrainingSettings, setting_type


def flag(name: str) -> str:
    """A field's flag: `global_batch` -> `--global-batch`."""
    return "--" + name.replace("_", "-")


def add_training_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
) -> None:
    """Add one flag per setting; `defaults` overrides the settings' own defaults by field name
    (a list setting's flag has none: absent, the setting keeps its own)."""
    defaults = defaults or {}
    group = parser.add_argument_group("training settings")
    for f in fields(TrainingSettings):
        if setting_type(f.type) is tuple:
            group.add_argument(
                flag(f.name), dest=f.name, action="append", metavar=f.metadata["metavar"],
                help=f.metadata["help"],
            )  # fmt: skip
            continue
        default = defaults.get(f.name, f.default)
        shown = "" if default is None else f" (default {default})"
        group.add_argument(
            flag(f.name), dest=f.name, type=setting_type(f.type), default=default,
            choices=f.metadata.get("choices"), help=f.metadata["help"] + shown,
        )  # fmt: skip


def training_from_flags(args: argparse.Namespace) -> TrainingSettings:
    """The settings the flags added by `add_training_flags` give; InvalidInput names a list
    setting's flag whose text is not an entry."""
    values: dict[str, Any] = {}
    for f in fields(TrainingSettings):
        value = getattr(args, f.name)
        if setting_type(f.type) is tuple:
            if value is None:
                continue
            value = tuple(_entry(f, text) for text in value)
        values[f.name] = value
    return TrainingSettings(**values)


def _entry(f: Field[Any], text: str) -> tuple[int, ...]:
    """One entry of a list setting's flag: integers >= 0 separated by colons, as its `metavar`
    metadata shows."""
    metavar, parts = f.metadata["metavar"], text.split(":")
    if len(parts) != metavar.count(":") + 1 or not all(p.strip().isdecimal() for p in parts):
        raise InvalidInput(
            f"{flag(f.name)} {text!r}: expected {metavar}, e.g. {f.metadata['example']}"
        )
    return tuple(int(p) for p in parts)
