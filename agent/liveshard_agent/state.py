"""A member's training state: the boxes of every logical tensor it holds under a layout.

Each box is stored as its own torch tensor of the box's shape (on CPU or CUDA). States can be
filled from a seed so that any box's content anywhere is known (`seeded_box`), and checksummed per
logical tensor in a way that does not depend on the layout: the checksum of a tensor is a sum over
disjoint boxes, so any layout's designated holders add up to the same value.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .layout.layout import Layout
from .layout.region import Placed, partition, place, rank_boxes
from .vps.box import Box, volume
from .vps.spec import DType, ModelSpec, StateKind, TensorRef

TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}
_BITS = {2: torch.int16, 4: torch.int32}
_PRIME = 2147483647  # 2**31 - 1


def _flat_index(shape: tuple[int, ...], box: Box, device: torch.device) -> torch.Tensor:
    """Global flat (row-major) index of every element of `box`, as an int64 tensor."""
    flat = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        start, stop = box[dim]
        view = [1] * len(shape)
        view[dim] = stop - start
        flat = flat + torch.arange(start, stop, device=device).view(view) * stride
        stride *= shape[dim]
    return flat


def tensor_salt(spec: ModelSpec, ref: TensorRef, seed: int) -> int:
    return (zlib.crc32(spec.tensor_name(ref).encode()) + seed * 7919) % _PRIME


def seeded_box(
    spec: ModelSpec, ref: TensorRef, box: Box, seed: int, device: torch.device
) -> torch.Tensor:
    """The seeded content of `box` of logical tensor `ref`: a function of the global index only."""
    shape = spec.params[ref.param].shape
    x = (_flat_index(shape, box, device) % _PRIME * 48271 + tensor_salt(spec, ref, seed)) % _PRIME
    values = x.to(torch.float32) / _PRIME - 0.5
    return values.to(TORCH_DTYPES[spec.dtype(ref.kind)])


def checksum_mask(element_size: int) -> int:
    """Checksums of a dtype are compared modulo 2**(8 * element size): sums accumulate, wrapping,
    in the integer type of the element's own width, which keeps them at memory speed."""
    return (1 << (8 * element_size)) - 1


def box_checksum(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """(sum, row-weighted sum, column-weighted sum) of the tensor's bit patterns, modulo
    `checksum_mask`. Additive over disjoint boxes (modulo the same), and sensitive to values
    changed or moved to another row or column."""
    bits_type = _BITS[tensor.element_size()]
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
    return sums & checksum_mask(tensor.element_size())


@dataclass
class ShardedState:
    """The boxes a rank holds under `layout`, keyed by logical tensor in canonical order."""

    spec: ModelSpec
    layout: Layout
    rank: int
    device: torch.device
    boxes: dict[TensorRef, list[tuple[Box, torch.Tensor]]]

    @classmethod
    def allocate(
        cls, spec: ModelSpec, layout: Layout, rank: int, device: torch.device
    ) -> ShardedState:
        """Zeroed storage for every box of the rank's region (a shadow to receive into); zeroing
        touches every page, so later writes do not pay for page faults."""
        boxes: dict[TensorRef, list[tuple[Box, torch.Tensor]]] = {}
        for ref, placed in _placements(spec, layout):
            dtype = TORCH_DTYPES[spec.dtype(ref.kind)]
            held = rank_boxes(layout, placed, rank)
            if held:
                boxes[ref] = [
                    (b, torch.zeros([hi - lo for lo, hi in b], dtype=dtype, device=device))
                    for b in held
                ]
        return cls(spec, layout, rank, device, boxes)

    @classmethod
    def seeded(
        cls, spec: ModelSpec, layout: Layout, rank: int, seed: int, device: torch.device
    ) -> ShardedState:
        state = cls.allocate(spec, layout, rank, device)
        for ref, box, tensor in state.items():
            tensor.copy_(seeded_box(spec, ref, box, seed, device))
        return state

    def items(self) -> Iterator[tuple[TensorRef, Box, torch.Tensor]]:
        for ref, held in self.boxes.items():
            for box, tensor in held:
                yield ref, box, tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, t in self.items())

    def view(self, ref: TensorRef, piece: Box) -> torch.Tensor:
        """The part of the stored tensor that holds `piece`; it must lie inside one held box."""
        for box, tensor in self.boxes.get(ref, ()):
            if all(b0 <= p0 and p1 <= b1 for (b0, b1), (p0, p1) in zip(box, piece, strict=True)):
                index = tuple(
                    slice(p0 - b0, p1 - b0) for (b0, _), (p0, p1) in zip(box, piece, strict=True)
                )
                return tensor[index]
        name = self.spec.tensor_name(ref)
        raise KeyError(f"rank {self.rank} holds no box of {name} containing {piece}")

    def checksums(self) -> torch.Tensor:
        """Per logical tensor (canonical order), the checksum of the boxes this rank is the
        designated (lowest-ranked) holder of; summed over all ranks it is layout-independent."""
        refs = self.spec.tensors()
        out = torch.zeros((len(refs), 3), dtype=torch.int64, device=self.device)
        row = {ref: i for i, ref in enumerate(refs)}
        designated = _designated_boxes(self.spec, self.layout, self.rank)
        for ref, box, tensor in self.items():
            if box in designated.get(ref, ()):
                out[row[ref]] += box_checksum(tensor, box)
        return out

    def matches_seed(self, seed: int) -> list[str]:
        """Names of tensors whose boxes differ from the seeded expectation (empty if all equal)."""
        bad = []
        for ref, box, tensor in self.items():
            expected = seeded_box(self.spec, ref, box, seed, self.device)
            if not torch.equal(
                tensor.view(_BITS[tensor.element_size()]),
                expected.view(_BITS[tensor.element_size()]),
            ):
                bad.append(f"{self.spec.tensor_name(ref)}{list(box)}")
        return bad


def _placements(spec: ModelSpec, layout: Layout) -> Iterator[tuple[TensorRef, Placed]]:
    for i, param in enumerate(spec.params):
        for kind in StateKind:
            yield TensorRef(i, kind), place(spec, layout, param, kind)


def _designated_boxes(spec: ModelSpec, layout: Layout, rank: int) -> dict[TensorRef, set[Box]]:
    cache: dict[Placed, set[Box]] = {}
    out = {}
    for ref, placed in _placements(spec, layout):
        if placed not in cache:
            cache[placed] = {
                box for box, holders in partition(layout, placed) if holders[0] == rank
            }
        if cache[placed]:
            out[ref] = cache[placed]
    return out


def state_bytes_of(spec: ModelSpec, layout: Layout, rank: int) -> int:
    """Bytes a rank holds under `layout`, without allocating."""
    return sum(
        volume(box) * spec.dtype(ref.kind).itemsize
        for ref, placed in _placements(spec, layout)
        for box in rank_boxes(layout, placed, rank)
    )
