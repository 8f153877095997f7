"""Tensor classes: logical tensors placed alike under both layouts of a change.

Tensors of one class have equal regions on every rank under the old and the new layout, so their
pieces are computed once (`matching.Matching`) and shared. For a 235B model the thousands of
logical tensors fall into a few hundred classes; planning cost follows the classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..layout.layout import Layout
from ..layout.region import Placed, place
from ..vps.spec import ModelSpec, Placement, StateKind, TensorRef

# Kinds that ZeRO shards alike and store in one dtype: the parameter, and its fp32 state.
_KIND_SETS = ((StateKind.PARAM,), (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ))


@dataclass(frozen=True)
class TensorClass:
    """Tensors placed alike under both layouts: every kind in `kinds` of every param in `params`."""

    old: Placed
    new: Placed
    itemsize: int
    params: tuple[int, ...]
    kinds: tuple[StateKind, ...]

    def __len__(self) -> int:
        return len(self.params) * len(self.kinds)

    def tensor(self, i: int) -> TensorRef:
        """The i-th tensor of the class: params outer, kinds inner (the canonical order)."""
        param, kind = divmod(i, len(self.kinds))
        return TensorRef(self.params[param], self.kinds[kind])

    @property
    def tensors(self) -> list[TensorRef]:
        return [TensorRef(p, k) for p in self.params for k in self.kinds]


def tensor_classes(spec: ModelSpec, old: Layout, new: Layout) -> list[TensorClass]:
    """Every logical tensor, grouped into classes, in the order of each class's first tensor.

    Parameters are grouped by (shape, split, parts, stages and expert owner under both layouts)
    in a few array operations, since this runs over every parameter of a 235B model; placement
    is then computed once per group.
    """
    shapes, _, _, _ = spec.signatures
    where = np.asarray(shapes, dtype=np.int64)
    for layout in (old, new):
        stages, owners = _where(spec, layout)
        # Mixed radix: stage numbers lie in [0, pp], owners in [-1, ep).
        where = (where * (layout.pp + 1) + stages) * (layout.ep + 1) + owners + 1
    _, first, inverse = np.unique(where, return_index=True, return_inverse=True)
    members = np.argsort(inverse, kind="stable")
    groups = np.split(members, np.cumsum(np.bincount(inverse))[:-1])
    kind_sets = [ks for ks in (tuple(k for k in s if k in spec.kinds) for s in _KIND_SETS) if ks]
    classes: dict[tuple[Placed, Placed, int, tuple[StateKind, ...]], list[int]] = {}
    for g in np.argsort(first, kind="stable"):
        params = groups[g].tolist()
        param = spec.params[params[0]]
        for kinds in kind_sets:
            key = (
                place(spec, old, param, kinds[0]),
                place(spec, new, param, kinds[0]),
                spec.dtype(kinds[0]).itemsize,
                kinds,
            )
            classes.setdefault(key, []).extend(params)
    out = [
        TensorClass(o, n, size, tuple(sorted(ps)), ks) for (o, n, size, ks), ps in classes.items()
    ]
    return sorted(out, key=lambda c: (c.params[0], c.kinds[0] is not StateKind.PARAM))


def _where(spec: ModelSpec, layout: Layout) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Per parameter under `layout`: a number for the stages that hold it (equal numbers, equal
    stages: `region.stages_of`), and its expert owner (-1: not an expert; `region.owner_of`)."""
    _, placements, layers, experts = spec.signatures
    stage_of_layer = np.asarray(layout.stage_of_layer, dtype=np.int64)
    layer = np.asarray(layers, dtype=np.int64)
    fixed = {
        Placement.FIRST: 0,
        Placement.LAST: layout.pp - 1,
        Placement.FIRST_AND_LAST: layout.pp if layout.pp > 1 else 0,  # (0, pp - 1)
    }
    by_placement = np.asarray([fixed.get(p, -1) for p in Placement], dtype=np.int64)
    constant = by_placement[np.asarray(placements, dtype=np.int64)]
    stages = np.where(layer >= 0, stage_of_layer[np.maximum(layer, 0)], constant)
    expert = np.asarray(experts, dtype=np.int64)
    per_owner = max(spec.config.experts // layout.ep, 1)
    owners = np.where(expert >= 0, expert // per_owner, -1)
    return stages, owners
