"""The model's weights on one rank: the engine's sharded state, seen as the tensors a stage
computes with.

A rank computes with the tensor-parallel-local part of each parameter its pipeline stage (and, for
experts, its ep rank) holds: one tensor per TP-local box, in part order, so a fused `qkv` is its
q, k and v parts and nothing needs reshuffling. Below ZeRO-3 those tensors share storage with the
state's parameter boxes (the model reads and writes the state itself; a committed shadow is the
new model). Under ZeRO-3 the state holds only a shard; `gather` fills full local tensors from the
shards of the rank's data-parallel group before each step.

A weight's gradient is summed over its data-parallel replicas: the dp group, or the expert-dp
group for experts. Replicated weights that each tp rank sees part of (q and k norms) are summed
over tp first, and a tied embedding held by the first and the last stage over both.

A mirrored layout without replicas (dp = 1, experts of ep = dp) has each box its holder
computes with held also by the holder's *peer* (`region.place`). The peer computes nothing with
it: `Peers` says which boxes this rank sends the gradients of, to whom, and which copies it
holds, from whom; the optimizer updates a copy from the gradients its holder sent, as the
holder updates its box.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from liveshard_core.layout.layout import Layout
from liveshard_core.layout.region import partition, place, rank_boxes
from liveshard_core.vps.box import Box, box_shape
from liveshard_core.vps.spec import ModelSpec, Param, Placement, StateKind

from ..engine.state import TORCH_DTYPES, ShardedState
from ..engine.world import Axis, World
from . import comm

_TP_PARTIAL = ("q_norm", "k_norm")


def box_view(boxes: list[Box], tensors: list[torch.Tensor], piece: Box) -> torch.Tensor:
    """The part of the tensor of the box that contains `piece`."""
    for box, tensor in zip(boxes, tensors, strict=True):
        if all(b0 <= p0 and p1 <= b1 for (b0, b1), (p0, p1) in zip(box, piece, strict=True)):
            return tensor[
                tuple(slice(p0 - b0, p1 - b0) for (b0, _), (p0, p1) in zip(box, piece, strict=True))
            ]
    raise KeyError(f"no box of {boxes} contains {piece}")


@dataclass
class Weight:
    """One parameter on this rank."""

    index: int  # in ModelSpec.params
    param: Param
    boxes: list[Box]  # TP-local boxes, in part order
    tensors: list[torch.Tensor]  # what the model computes with: leaves that require grad
    reduce: Axis  # the replicas that sum its gradient: DP or EXPERT_DP
    shards: list[Box]  # the boxes of its optimizer state this rank holds and updates
    counted: list[bool]  # per shard: whether this rank counts it in the global norm
    own: list[Box]  # its ZeRO shard: the shards but a mirrored predecessor's (`Layout.mirror`)
    tp_partial: bool = False
    tied: bool = False

    @property
    def name(self) -> str:
        return self.param.name

    @property
    def elements(self) -> int:
        return sum(t.numel() for t in self.tensors)


Route = list[tuple[Param, Box]]
"""Boxes of some parameters, in parameter order and each parameter's boxes in ordinal order: what
one message between a rank and its peer carries."""


@dataclass
class Peers:
    """The copies of a mirrored layout's boxes no replica holds, from this rank's side: the boxes
    it computes with whose copy another rank holds (`sends`, by that rank), and the copies it
    holds (`copies`, by the rank that computes with them)."""

    sends: dict[int, Route] = field(default_factory=dict)
    copies: dict[int, Route] = field(default_factory=dict)

    @classmethod
    def build(cls, spec: ModelSpec, layout: Layout, rank: int) -> Peers:
        out = cls()
        if not layout.mirror:
            return out
        for param in spec.params:
            shared = place(spec, layout, param, StateKind.EXP_AVG)
            alone = place(spec, layout, param, StateKind.EXP_AVG, peer=False)
            if shared == alone:
                continue
            owners = dict(partition(layout, alone))
            for box, holders in partition(layout, shared):
                # The holders and their peers, each in rank order: one pair per tp index
                # when the stage's tp ranks hold the box alike.
                peers = sorted(set(holders) - set(owners[box]))
                for owner, peer in zip(owners[box], peers, strict=True):
                    if rank == owner:
                        out.sends.setdefault(peer, []).append((param, box))
                    elif rank == peer:
                        out.copies.setdefault(owner, []).append((param, box))
        return out

    def held(self) -> Route:
        """Every copy this rank holds."""
        return [item for route in self.copies.values() for item in route]


@dataclass
class Weights:
    """Every weight of this rank's stage, by name, with the layout's geometry."""

    spec: ModelSpec
    layout: Layout
    rank: int
    state: ShardedState
    world: World
    by_name: dict[str, Weight] = field(default_factory=dict)
    peers: Peers = field(default_factory=Peers)

    @classmethod
    def build(cls, state: ShardedState, world: World) -> Weights:
        spec, layout, rank = state.spec, state.layout, state.rank
        out = cls(spec, layout, rank, state, world, peers=Peers.build(spec, layout, rank))
        zero3 = layout.zero >= 3
        unmirrored = dataclasses.replace(layout, mirror=False)
        for index, param in enumerate(spec.params):
            # What this rank computes with: its boxes without the copies it holds for a peer.
            param_place = place(spec, layout, param, StateKind.PARAM, peer=False)
            local = rank_boxes(layout, dataclasses.replace(param_place, sharded=False), rank)
            if not local:
                continue
            if zero3:  # full local tensors, filled from the shards by `gather`
                dtype = TORCH_DTYPES[spec.dtype(StateKind.PARAM)]
                tensors = [
                    torch.zeros(box_shape(box), dtype=dtype, device=state.device) for box in local
                ]
            else:  # the state's own parameter boxes (shared storage)
                held = dict(state.boxes_of(spec.ref(param.name)))
                tensors = [held[box].detach() for box in local]
            for t in tensors:
                t.requires_grad_(True)
            opt_place = place(spec, layout, param, StateKind.EXP_AVG, peer=False)
            shards = rank_boxes(layout, opt_place, rank)
            own = rank_boxes(unmirrored, opt_place, rank) if layout.mirror else shards
            designated = {
                box for box, holders in partition(layout, opt_place) if holders[0] == rank
            }
            out.by_name[param.name] = Weight(
                index=index,
                param=param,
                boxes=local,
                tensors=tensors,
                reduce=Axis.EXPERT_DP if param.expert is not None else Axis.DP,
                shards=shards,
                counted=[box in designated for box in shards],
                own=own,
                tp_partial=param.name.rsplit(".", 1)[-1] in _TP_PARTIAL and layout.tp > 1,
                tied=param.placement is Placement.FIRST_AND_LAST and layout.pp > 1,
            )
        return out

    def __getitem__(self, name: str) -> Weight:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def all(self) -> list[Weight]:
        return list(self.by_name.values())

    def param_view(self, weight: Weight, piece: Box) -> torch.Tensor:
        """The state's parameter storage of `piece` (a shard box)."""
        return self.state.view(self.spec.ref(weight.name), piece)

    def by_reduce(self) -> dict[Axis, list[Weight]]:
        """The weights of each reduction axis that has any."""
        out: dict[Axis, list[Weight]] = {}
        for w in self.all():
            out.setdefault(w.reduce, []).append(w)
        return out

    @torch.no_grad()
    def sync_from_shards(self) -> None:
        """Fill every weight's full local tensors from the parameter rows of its replicas'
        shards (each replica contributes the rows of its own shard, never of a mirrored one)."""
        for axis, weights in self.by_reduce().items():
            flat = _assemble(weights, self.param_view, self.state.device)
            comm.all_reduce(flat, self.world.group(axis))
            _scatter(weights, flat)

    def gather(self) -> None:
        """ZeRO-3: full local tensors for the next forward and backward."""
        if self.layout.zero >= 3:
            self.sync_from_shards()


def _assemble(
    weights: list[Weight], source: Callable[[Weight, Box], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """A flat buffer of every weight's local tensors, zero except the rows of this rank's own
    shards, which come from `source(weight, shard)`; summed over the replicas (each row is
    nonzero at exactly one of them, and adding zeros is exact) it holds every row."""
    total = sum(w.elements for w in weights)
    flat = torch.zeros(total, dtype=weights[0].tensors[0].dtype, device=device)
    offset = 0
    for w in weights:
        views = []
        for t in w.tensors:
            views.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        for shard in w.own:
            box_view(w.boxes, views, shard).copy_(source(w, shard))
    return flat


def _scatter(weights: list[Weight], flat: torch.Tensor) -> None:
    offset = 0
    for w in weights:
        for t in w.tensors:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
