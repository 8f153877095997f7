"""Tensor classes: logical tensors placed alike under both layouts of a change.

Tensors of one class have equal regions on every rank under the old and the new layout, so their
pieces are computed once (`matching.Matching`) and shared. For a 235B model the thousands of
logical tensors fall into a few hundred classes; planning cost follows the classes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..layout.layout import Layout
from ..layout.region import Placed, owner_of, place, stages_of
from ..vps.spec import ModelSpec, StateKind, TensorRef

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

    Placement is computed once per distinct (param signature, stage, expert owner), not per tensor:
    this loop runs over every parameter of a 235B model.
    """
    by_key: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, p in enumerate(spec.params):
        where = (
            stages_of(old, p),
            owner_of(spec, old, p),
            stages_of(new, p),
            owner_of(spec, new, p),
        )
        by_key[(p.shape, p.split_dim, p.parts, *where)].append(i)
    kind_sets = [ks for ks in (tuple(k for k in s if k in spec.kinds) for s in _KIND_SETS) if ks]
    classes: dict[tuple[Placed, Placed, int, tuple[StateKind, ...]], list[int]] = {}
    for params in by_key.values():
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
