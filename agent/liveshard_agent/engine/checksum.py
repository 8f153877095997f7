"""The checksum format of training state: computing it, adding it up and comparing it.

The checksum of a logical tensor is, over disjoint boxes, the sum of (sum of the elements' bit
patterns, row-weighted sum, column-weighted sum), modulo 2**(8 * element size). Each box is
counted by its lowest-ranked holder only, so summed over every rank of any layout the total is the
same: the switch all-reduces the old layout's and the new layout's checksums and compares them. A
value that is lost, changed or moved to another row or column changes the total. Sums accumulate,
wrapping, in the integer type of the element's own width, which keeps them at memory speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liveshard_core.layout.region import partition
from liveshard_core.vps.box import Box
from liveshard_core.vps.spec import ModelSpec, TensorRef

from .state import BITS, ShardedState, placements

WIDTH = 3  # (sum, row-weighted sum, column-weighted sum)


def mask(element_size: int) -> int:
    """Checksums of a dtype are compared modulo 2**(8 * element size)."""
    return (1 << (8 * element_size)) - 1


def box_checksum(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The WIDTH sums of one box's elements, modulo `mask`. Additive over disjoint boxes."""
    bits_type = BITS[tensor.element_size()]
    bits = tensor.contiguous().view(bits_type)
    rows = bits.reshape(bits.shape[0], -1) if bits.dim() else bits.reshape(1, 1)
    row_sums = rows.sum(1, dtype=bits_type).to(torch.int64)
    row_ids = torch.arange(box[0][0] + 1, box[0][1] + 1, device=bits.device)
    col_term = torch.zeros((), dtype=torch.int64, device=bits.device)
    if bits.dim() >= 2:
        cols = bits.reshape(bits.shape[0], bits.shape[1], -1).sum((0, 2), dtype=bits_type)
        col_ids = torch.arange(box[1][0] + 1, box[1][1] + 1, device=bits.device)
        col_term = (cols.to(torch.int64) * col_ids).sum()
    sums = torch.stack([row_sums.sum(), (row_sums * row_ids).sum(), col_term])
    return sums & mask(tensor.element_size())


@dataclass(frozen=True)
class Checksums:
    """One row of WIDTH sums per logical tensor of `spec`, in canonical order."""

    spec: ModelSpec
    sums: torch.Tensor  # int64 [tensors, WIDTH]

    @classmethod
    def zeros(cls, spec: ModelSpec, device: torch.device) -> Checksums:
        return cls(
            spec, torch.zeros((len(spec.tensors()), WIDTH), dtype=torch.int64, device=device)
        )

    @classmethod
    def of_state(cls, state: ShardedState) -> Checksums:
        """This rank's share: the boxes it is the designated (lowest-ranked) holder of."""
        out = cls.zeros(state.spec, state.device)
        row = {ref: i for i, ref in enumerate(state.spec.tensors())}
        designated = _designated_boxes(state)
        for ref, box, tensor in state.items():
            if box in designated.get(ref, ()):
                out.sums[row[ref]] += box_checksum(tensor, box)
        return out

    @classmethod
    def from_flat(cls, spec: ModelSpec, flat: torch.Tensor) -> Checksums:
        return cls(spec, flat.view(-1, WIDTH))

    @property
    def flat(self) -> torch.Tensor:
        return self.sums.flatten()

    def reduced(self) -> torch.Tensor:
        """The sums, each modulo its tensor's `mask`: equal totals compare equal."""
        return self.sums & _masks(self.spec, self.sums.device)

    def differing(self, other: Checksums) -> list[TensorRef]:
        """The logical tensors whose totals differ between `self` and `other`."""
        bad = (self.reduced() != other.reduced()).any(dim=1).nonzero().flatten().tolist()
        refs = self.spec.tensors()
        return [refs[i] for i in bad]


def _masks(spec: ModelSpec, device: torch.device) -> torch.Tensor:
    values = [mask(spec.dtype(ref.kind).itemsize) for ref in spec.tensors()]
    return torch.tensor(values, dtype=torch.int64, device=device).unsqueeze(1)


def _designated_boxes(state: ShardedState) -> dict[TensorRef, set[Box]]:
    cache: dict[object, set[Box]] = {}
    out = {}
    for ref, placed in placements(state.spec, state.layout):
        if placed not in cache:
            cache[placed] = {
                box for box, holders in partition(state.layout, placed) if holders[0] == state.rank
            }
        if cache[placed]:
            out[ref] = cache[placed]
    return out
