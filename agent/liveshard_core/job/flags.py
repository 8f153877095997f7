"""The training settings as command-line flags: one flag per `TrainingSettings` field, named
after it (`global_batch` -> `--global-batch`), typed, documented and (where the field lists them)
limited to its choices by the field itself."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from .settings import TrainingSettings, setting_type


def flag(name: str) -> str:
    """A field's flag: `global_batch` -> `--global-batch`."""
    return "--" + name.replace("_", "-")


def add_training_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
) -> None:
    """Add one flag per setting; `defaults` overrides the settings' own defaults by field name."""
    defaults = defaults or {}
    group = parser.add_argument_group("training settings")
    for f in fields(TrainingSettings):
        default = defaults.get(f.name, f.default)
        shown = "" if default is None else f" (default {default})"
        group.add_argument(
            flag(f.name), dest=f.name, type=setting_type(f.type), default=default,
            choices=f.metadata.get("choices"), help=f.metadata["help"] + shown,
        )  # fmt: skip


def training_from_flags(args: argparse.Namespace) -> TrainingSettings:
    """The settings the flags added by `add_training_flags` give."""
    return TrainingSettings(**{f.name: getattr(args, f.name) for f in fields(TrainingSettings)})
