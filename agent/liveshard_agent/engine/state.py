"""A member's training state: the boxes of every logical tensor it holds under a layout.

Each box is stored as its own torch tensor of the box's shape (on CPU or CUDA), looked up by
logical tensor (`TensorRef`, or a parameter's name and state kind). A state is allocated (zeroed),
seeded (content a function of the global index, so any box's content anywhere is known: the tests'
and benchmarks' ground truth), or built from tensors the caller already has.

Contract with the switch (`switch.Reconfiguration.switch`):
- on commit, the caller's old state object is *released*: its boxes are emptied and `released`
  is set, so a stale reference fails loudly instead of reading freed memory; the tensors are freed
  once the caller drops its own references to them;
- on abort, the caller gets the very same object back, untouched (bit for bit), and keeps
  training on it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout
from liveshard_core.layout.region import Placed, place, rank_boxes
from liveshard_core.vps.box import Box, box_shape, volume
from liveshard_core.vps.spec import DType, ModelSpec, StateKind, TensorRef

TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}
BITS = {2: torch.int16, 4: torch.int32}  # an element's bit pattern, by element size
_PRIME = 2147483647  # 2**31 - 1

Boxes = list[tuple[Box, torch.Tensor]]


def placements(spec: ModelSpec, layout: Layout) -> Iterator[tuple[TensorRef, Placed]]:
    """Every logical tensor of `spec` with its placement under `layout`, in canonical order."""
    for ref in spec.tensors():
        yield ref, place(spec, layout, spec.params[ref.param], ref.kind)


def region_boxes(spec: ModelSpec, layout: Layout, rank: int) -> dict[TensorRef, list[Box]]:
    """The non-empty boxes `rank` holds of each logical tensor (tensors it holds none of are
    absent), in canonical order."""
    out = {}
    for ref, placed in placements(spec, layout):
        boxes = rank_boxes(layout, placed, rank)
        if boxes:
            out[ref] = boxes
    return out


@dataclass
class ShardedState:
    """The boxes a rank holds under `layout`, keyed by logical tensor in canonical order."""

    spec: ModelSpec
    layout: Layout
    rank: int
    device: torch.device
    boxes: dict[TensorRef, Boxes]
    released: bool = field(default=False)

    @classmethod
    def allocate(
        cls, spec: ModelSpec, layout: Layout, rank: int, device: torch.device
    ) -> ShardedState:
        """Zeroed storage for every box of the rank's region (a shadow to receive into); zeroing
        touches every page, so later writes do not pay for page faults."""

        def zeros(ref: TensorRef, box: Box) -> torch.Tensor:
            return torch.zeros(
                box_shape(box), dtype=TORCH_DTYPES[spec.dtype(ref.kind)], device=device
            )

        boxes = {
            ref: [(b, zeros(ref, b)) for b in held]
            for ref, held in region_boxes(spec, layout, rank).items()
        }
        return cls(spec, layout, rank, device, boxes)

    @classmethod
    def seeded(
        cls, spec: ModelSpec, layout: Layout, rank: int, seed: int, device: torch.device
    ) -> ShardedState:
        state = cls.allocate(spec, layout, rank, device)
        for ref, box, tensor in state.items():
            tensor.copy_(seeded_box(spec, ref, box, seed, device))
        return state

    @classmethod
    def from_tensors(
        cls,
        spec: ModelSpec,
        layout: Layout,
        rank: int,
        tensors: Mapping[TensorRef, Sequence[torch.Tensor]],
    ) -> ShardedState:
        """A state over tensors the caller already has (no copy): for each logical tensor the
        rank holds, one tensor per box of its region, in region order (`region_boxes`). Every
        shape, dtype and device is checked; a missing or extra tensor is an error naming it."""
        expected = region_boxes(spec, layout, rank)
        extra = [spec.tensor_name(ref) for ref in tensors if ref not in expected]
        missing = [spec.tensor_name(ref) for ref in expected if ref not in tensors]
        if extra or missing:
            raise InvalidInput(
                f"rank {rank} of {layout.describe()}: tensors given for {extra[:5]} which the "
                f"rank does not hold, none given for {missing[:5]} which it holds"
            )
        devices = {t.device for ts in tensors.values() for t in ts}
        if len(devices) > 1:
            raise InvalidInput(
                f"rank {rank}: tensors on several devices {sorted(map(str, devices))}"
            )
        boxes: dict[TensorRef, Boxes] = {}
        for ref, held in expected.items():
            given = list(tensors[ref])
            name = spec.tensor_name(ref)
            dtype = TORCH_DTYPES[spec.dtype(ref.kind)]
            if len(given) != len(held):
                raise InvalidInput(
                    f"{name}: {len(given)} tensors given for the {len(held)} boxes {held}"
                )
            for box, t in zip(held, given, strict=True):
                shape = box_shape(box)
                if t.shape != shape or t.dtype != dtype:
                    raise InvalidInput(
                        f"{name} box {list(box)}: expected {dtype} of shape {list(shape)}, "
                        f"got {t.dtype} of shape {list(t.shape)}"
                    )
            boxes[ref] = list(zip(held, given, strict=True))
        device = devices.pop() if devices else torch.device("cpu")
        return cls(spec, layout, rank, device, boxes)

    def _live(self) -> None:
        if self.released:
            raise RuntimeError(
                f"rank {self.rank}'s state under {self.layout.describe()} was released by a "
                "committed switch; use the state the switch returned"
            )

    def get(self, name: str, kind: StateKind = StateKind.PARAM) -> Boxes:
        """The boxes this rank holds of parameter `name`'s `kind` tensor (empty if none)."""
        return self.boxes_of(self.spec.ref(name, kind))

    def boxes_of(self, ref: TensorRef) -> Boxes:
        self._live()
        return self.boxes.get(ref, [])

    def items(self) -> Iterator[tuple[TensorRef, Box, torch.Tensor]]:
        self._live()
        for ref, held in self.boxes.items():
            for box, tensor in held:
                yield ref, box, tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, t in self.items())

    def view(self, ref: TensorRef, piece: Box) -> torch.Tensor:
        """The part of the stored tensor that holds `piece`; it must lie inside one held box."""
        for box, tensor in self.boxes_of(ref):
            if all(b0 <= p0 and p1 <= b1 for (b0, b1), (p0, p1) in zip(box, piece, strict=True)):
                index = tuple(
                    slice(p0 - b0, p1 - b0) for (b0, _), (p0, p1) in zip(box, piece, strict=True)
                )
                return tensor[index]
        name = self.spec.tensor_name(ref)
        raise KeyError(f"rank {self.rank} holds no box of {name} containing {piece}")

    def release(self) -> None:
        """Drop this object's references to its tensors; any later use raises."""
        self.boxes.clear()
        self.released = True

    def matches_seed(self, seed: int) -> list[str]:
        """Names of tensors whose boxes differ from the seeded expectation (empty if all equal)."""
        bad = []
        for ref, box, tensor in self.items():
            expected = seeded_box(self.spec, ref, box, seed, self.device)
            if not torch.equal(_bits(tensor), _bits(expected)):
                bad.append(f"{self.spec.tensor_name(ref)}{list(box)}")
        return bad


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def flat_index(shape: tuple[int, ...], box: Box, device: torch.device) -> torch.Tensor:
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
    x = (flat_index(shape, box, device) % _PRIME * 48271 + tensor_salt(spec, ref, seed)) % _PRIME
    values = x.to(torch.float32) / _PRIME - 0.5
    return values.to(TORCH_DTYPES[spec.dtype(ref.kind)])


def state_bytes_of(spec: ModelSpec, layout: Layout, rank: int) -> int:
    """Bytes a rank holds under `layout`, without allocating."""
    return sum(
        volume(box) * spec.dtype(ref.kind).itemsize
        for ref, boxes in region_boxes(spec, layout, rank).items()
        for box in boxes
    )


def held_bytes_of(spec: ModelSpec, layout: Layout, rank: int) -> tuple[int, int]:
    """The bytes a rank holds under `layout` (`state_bytes_of`), and of them those of its
    predecessor's ZeRO shards and its peer's boxes (a mirrored layout's copies, `Layout.mirror`;
    0 without)."""
    held = state_bytes_of(spec, layout, rank)
    if not layout.mirror:
        return held, 0
    return held, held - state_bytes_of(spec, replace(layout, mirror=False), rank)
