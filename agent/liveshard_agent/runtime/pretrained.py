"""A rank's initial state from a Hugging Face model directory's safetensors weights, read sharded.

Each rank reads only the bytes of its own boxes: for every box of a parameter (and of its fp32
master), the table of `liveshard_core.vps.hf` names the Hugging Face tensors that fill it (a fused
`qkv` or `gate_up` from its parts), and safetensors' memory-mapped slices read exactly the
intersection. No rank ever holds the whole model, in any layout (tp, uneven pp, ep, ZeRO 0/1/3).
The Adam moments start at zero, as in a fresh start.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout
from liveshard_core.vps.box import Box
from liveshard_core.vps.hf import WEIGHTS, HfModel, Source
from liveshard_core.vps.spec import ModelSpec, StateKind

from ..engine.state import ShardedState


class _Files:
    """Open safetensors files by tensor name, each opened once."""

    def __init__(self, model: HfModel, stack: ExitStack) -> None:
        self.model, self.stack = model, stack
        self.where = model.weight_files()
        self.single = model.directory / WEIGHTS
        self.open: dict[Path, Any] = {}

    def slice(self, name: str) -> tuple[Any, Path]:
        path = self.where.get(name, self.single)
        if path not in self.open:
            try:
                self.open[path] = self.stack.enter_context(safe_open(str(path), "pt"))
            except Exception as err:  # OSError, or one of safetensors' own error types
                raise InvalidInput(f"cannot read weights {path}: {err}") from None
        handle = self.open[path]
        if name not in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
            raise InvalidInput(f"{path}: no tensor {name!r} ({self.model.architecture})")
        return handle.get_slice(name), path


@torch.no_grad()
def load_pretrained(
    model: HfModel, spec: ModelSpec, layout: Layout, rank: int, device: torch.device
) -> ShardedState:
    """The rank's boxes of the initial state: parameters and masters from `model`'s weights."""
    state = ShardedState.allocate(spec, layout, rank, device)
    sources = model.sources(spec)
    with ExitStack() as stack:
        files = _Files(model, stack)
        for ref, box, tensor in state.items():
            if ref.kind not in (StateKind.PARAM, StateKind.MASTER):
                continue
            shape = spec.params[ref.param].shape
            for source in sources[ref.param]:
                _fill(files, source, shape, box, tensor)
    return state


def _fill(
    files: _Files, source: Source, shape: tuple[int, ...], box: Box, out: torch.Tensor
) -> None:
    """Copy the part of `source` that falls in `box` into `out` (which holds `box`)."""
    lo, hi = box[source.dim]
    start, stop = max(lo, source.start), min(hi, source.stop)
    if start >= stop:
        return
    piece, path = files.slice(source.name)
    expected = list(shape)
    expected[source.dim] = source.stop - source.start
    if list(piece.get_shape()) != expected:
        raise InvalidInput(
            f"{path}: {source.name} has shape {piece.get_shape()}, the config gives {expected}"
        )
    read = tuple(
        slice(start - source.start, stop - source.start) if d == source.dim else slice(a, b)
        for d, (a, b) in enumerate(box)
    )
    into = tuple(
        slice(start - lo, stop - lo) if d == source.dim else slice(None) for d in range(len(box))
    )
    out[into].copy_(piece[read])
