"""Regions: the boxes of a logical tensor that a rank holds under a layout.

PP picks which tensors a rank holds at all; TP (and EP for experts) cuts boxes along a dimension;
DP replicates; ZeRO shards the rank's TP-local rows along dim 0 across its dp group (the expert-dp
group for experts), `torch.chunk` style. A fused dimension is split part by part, and a ZeRO shard
of a fused dim-0 tensor is a contiguous run of the local concatenation, so it may be two boxes.

Everything a tensor's boxes depend on is its `Placed` value; tensors with equal `Placed` values
under a layout have equal regions, which is what lets plans be computed once per class of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..vps.box import Box, chunk, full_box, is_empty, replace_dim
from ..vps.spec import ModelSpec, Param, Placement, StateKind, TensorRef
from .layout import Layout


@dataclass(frozen=True, slots=True)
class Placed:
    """All that a logical tensor's region under one layout depends on."""

    shape: tuple[int, ...]
    split_dim: int | None
    parts: tuple[int, ...] | None
    sharded: bool  # ZeRO shards it across the dp (or expert-dp) group
    stages: tuple[int, ...]  # the pipeline stages that hold it
    ep_owner: int | None  # for an expert: the ep rank that holds it


def stages_of(layout: Layout, param: Param) -> tuple[int, ...]:
    """The pipeline stages that hold `param` under `layout`."""
    if param.placement is Placement.LAYER:
        assert param.layer is not None
        return (layout.stage_of_layer[param.layer],)
    if param.placement is Placement.FIRST:
        return (0,)
    if param.placement is Placement.LAST:
        return (layout.pp - 1,)
    return (0, layout.pp - 1) if layout.pp > 1 else (0,)


def owner_of(spec: ModelSpec, layout: Layout, param: Param) -> int | None:
    """For an expert, the ep rank that holds it; None for every other parameter."""
    if param.expert is None:
        return None
    return param.expert // (spec.config.experts // layout.ep)


def place(spec: ModelSpec, layout: Layout, param: Param, kind: StateKind) -> Placed:
    """The placement of `param`'s `kind` tensor under `layout`."""
    return Placed(
        param.shape,
        param.split_dim,
        param.parts,
        kind.zero_sharded(layout.zero),
        stages_of(layout, param),
        owner_of(spec, layout, param),
    )


def tp_local_boxes(placed: Placed, tp: int, tp_i: int | None) -> list[Box]:
    """Boxes of tp rank `tp_i` (None: a replicated tensor, the whole of it)."""
    whole = full_box(placed.shape)
    if tp_i is None or placed.split_dim is None:
        return [whole]
    dim = placed.split_dim
    parts = placed.parts or (placed.shape[dim],)
    boxes, offset = [], 0
    for size in parts:
        start, stop = chunk(size, tp, tp_i)
        boxes.append(replace_dim(whole, dim, (offset + start, offset + stop)))
        offset += size
    return boxes


def zero_shard_boxes(placed: Placed, local: list[Box], shards: int, index: int) -> list[Box]:
    """Shard `index` of `shards` of the TP-local boxes, cut along dim 0 of the local tensor."""
    if placed.split_dim != 0:
        # Every local box spans dim 0 whole: the shard is the same rows of each.
        rows = chunk(placed.shape[0], shards, index)
        return [replace_dim(box, 0, rows) for box in local]
    # Dim 0 of the local tensor is the concatenation of the local boxes' dim-0 intervals.
    total = sum(box[0][1] - box[0][0] for box in local)
    lo, hi = chunk(total, shards, index)
    out, offset = [], 0
    for box in local:
        start, stop = box[0]
        a, b = max(lo, offset), min(hi, offset + stop - start)
        if a < b:
            out.append(replace_dim(box, 0, (start + a - offset, start + b - offset)))
        offset += stop - start
    return out


def _dp_group(layout: Layout, placed: Placed) -> list[int]:
    """dp indices that hold the tensor (all of dp, or the expert-dp group), in dp order."""
    if placed.ep_owner is None:
        return list(range(layout.dp))
    return list(range(placed.ep_owner, layout.dp, layout.ep))


def partition(layout: Layout, placed: Placed) -> list[tuple[Box, tuple[int, ...]]]:
    """The tensor's non-empty boxes, each with the sorted ranks that hold it.

    The boxes are disjoint and cover the tensor: replicas of a box are one entry with many holders.
    Holders come out sorted without sorting: a rank grows with (stage, dp index, tp index), stages
    are sorted, and the loops run in that order.
    """
    group = _dp_group(layout, placed)
    tp_keys: list[int | None] = list(range(layout.tp)) if placed.split_dim is not None else [None]
    out: list[tuple[Box, tuple[int, ...]]] = []
    for tp_key in tp_keys:
        tp_ranks = range(layout.tp) if tp_key is None else (tp_key,)
        local = tp_local_boxes(placed, layout.tp, tp_key)
        if placed.sharded:
            for z, dp_i in enumerate(group):
                holders = tuple(
                    layout.rank(s, dp_i, t) for s, t in product(placed.stages, tp_ranks)
                )
                out += [(box, holders) for box in zero_shard_boxes(placed, local, len(group), z)]
        else:
            holders = tuple(
                layout.rank(s, d, t) for s, d, t in product(placed.stages, group, tp_ranks)
            )
            out += [(box, holders) for box in local]
    return [(box, holders) for box, holders in out if not is_empty(box)]


def rank_boxes(layout: Layout, placed: Placed, rank: int) -> list[Box]:
    """The non-empty boxes that `rank` holds, computed from its coordinates alone."""
    pp_i, dp_i, tp_i = layout.coords(rank)
    if pp_i not in placed.stages:
        return []
    if placed.ep_owner is not None and dp_i % layout.ep != placed.ep_owner:
        return []
    local = tp_local_boxes(placed, layout.tp, tp_i)
    if placed.sharded:
        group_size = layout.dp if placed.ep_owner is None else layout.dp // layout.ep
        index = dp_i if placed.ep_owner is None else dp_i // layout.ep
        local = zero_shard_boxes(placed, local, group_size, index)
    return [box for box in local if not is_empty(box)]


def region(spec: ModelSpec, layout: Layout, rank: int, ref: TensorRef) -> list[Box]:
    """The boxes of logical tensor `ref` that `rank` holds under `layout`."""
    param = spec.params[ref.param]
    return rank_boxes(layout, place(spec, layout, param, ref.kind), rank)
