"""The shadow's storage: the new state laid out so that packed messages land in place.

A packed message whose pieces are all whole boxes of the receiver's new state is received straight
into one block of memory that those boxes then live in (each box a view of it, in the message's
order), so it needs no receive buffer and no copy out of one. Every other box has storage of its
own, as `ShardedState.allocate` gives it. The resident mode lays the whole shadow out in prepare
(`allocate_shadow`); the bounded mode builds the same blocks as their rounds come (`landing_views`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liveshard_core.layout.layout import Layout
from liveshard_core.vps.box import Box, box_shape
from liveshard_core.vps.spec import ModelSpec, TensorRef

from .program import Message, Program
from .state import TORCH_DTYPES, ShardedState, region_boxes


@dataclass
class Shadow:
    """A new state and the blocks its packed messages land in, by (round, message index)."""

    state: ShardedState
    landings: dict[tuple[int, int], torch.Tensor]


def regions(block: torch.Tensor, message: Message, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The parts of a packed message's byte `block`, each viewed as its piece (of `dtypes`)."""
    sizes = [p.nbytes for p in message.parts]
    return [
        chunk.view(dtype).view(p.shape)
        for chunk, dtype, p in zip(torch.split(block, sizes), dtypes, message.parts, strict=True)
    ]


def landing_views(
    spec: ModelSpec, message: Message, block: torch.Tensor
) -> list[tuple[TensorRef, int, torch.Tensor]]:
    """The boxes (tensor, box index, view) that a landing `block` of `message` holds."""
    dtypes = [TORCH_DTYPES[spec.dtype(p.ref.kind)] for p in message.parts]
    views = regions(block, message, dtypes)
    return [(p.ref, p.at.index, v) for p, v in zip(message.parts, views, strict=True)]


def allocate_shadow(
    spec: ModelSpec, layout: Layout, rank: int, device: torch.device, program: Program
) -> Shadow:
    """The zeroed shadow of `rank` under `layout` (zeroing touches every page, so the pause pays
    no page faults), with a landing block for every packed message of whole boxes."""
    held = region_boxes(spec, layout, rank)
    tensors: dict[tuple[TensorRef, int], torch.Tensor] = {}
    landings = {}
    for r, round_ in enumerate(program.rounds):
        for i, message in enumerate(round_.messages):
            if message.lands_in_place:
                block = torch.zeros(message.nbytes, dtype=torch.uint8, device=device)
                landings[(r, i)] = block
                for ref, index, tensor in landing_views(spec, message, block):
                    tensors[(ref, index)] = tensor
    boxes: dict[TensorRef, list[tuple[Box, torch.Tensor]]] = {}
    for ref, ref_boxes in held.items():
        dtype = TORCH_DTYPES[spec.dtype(ref.kind)]
        boxes[ref] = []
        for i, box in enumerate(ref_boxes):
            landed = tensors.get((ref, i))
            if landed is None:
                landed = torch.zeros(box_shape(box), dtype=dtype, device=device)
            boxes[ref].append((box, landed))
    return Shadow(ShardedState(spec, layout, rank, device, boxes), landings)
