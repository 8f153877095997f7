"""The bounded memory mode: the old state's host copy, its device storage given back as the
transfer goes, and a shadow allocated box by box as it is filled.

At the switch the member copies its old boxes into host memory allocated in prepare (pinned on a
CUDA device); it cannot do so earlier, since training changes them until the switch step. From
then on the host copy is the old state's safe keeping: an old box's device storage is given back
(`UntypedStorage.resize_(0)`, under every reference to it, as FSDP frees its unsharded parameters)
once the transfer no longer reads it, round by round, and sooner when a new box needs the room
(after the operations in flight end); the rest of its sends and local copies read the host copy.
A new box is allocated when its first bytes arrive (one that only gets local copies, after the
last round); a box the member holds whole under both layouts is passed on as the same tensor. So
the member's device bytes never exceed the larger of its old and its new state, plus the buffers
in flight (within the budget): peak extra memory within the budget plus its own growth.

On abort, the shadow is dropped and every storage given back is reallocated and refilled from the
host copy: the old state object comes back with the same tensors, bit for bit. On commit, the old
state's tensors that were not passed on have no storage left: touching them, or views of them, is
undefined (the caller rebinds to the new state; see `state`).

A storage is given back only when the old state's boxes cover all of it (nothing else lives in
it), it can be resized, and no box of it is passed on; any other stays on the device, counted.

`BoundedMemory` is the mode's `executor.SwitchMemory`: the host copy allocated in prepare, the
`Bounded` storage built at the switch, the old state restored on abort. This module must not
decide whether a switch commits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout
from liveshard_core.vps.box import Box, box_shape
from liveshard_core.vps.spec import ModelSpec, TensorRef

from . import backend
from .executor import Memory, Storage, SwitchSide, view
from .program import LocalCopy, NewBox, Program
from .shadow import landing_views
from .state import TORCH_DTYPES, ShardedState, region_boxes

log = logging.getLogger(__name__)


class HostCopy:
    """Host memory for a member's old boxes, in region order: allocated and touched in prepare
    (so the switch pays no page faults), filled by `take` at the switch."""

    def __init__(self, layout: Layout, rank: int, boxes: dict[TensorRef, list[torch.Tensor]]):
        self.layout, self.rank, self.boxes = layout, rank, boxes

    @classmethod
    def allocate(cls, spec: ModelSpec, layout: Layout, rank: int, device: torch.device) -> HostCopy:
        pin = device.type == "cuda"  # pinned pages copy at full speed, asynchronously
        boxes = {
            ref: [
                torch.zeros(box_shape(b), dtype=TORCH_DTYPES[spec.dtype(ref.kind)], pin_memory=pin)
                for b in held
            ]
            for ref, held in region_boxes(spec, layout, rank).items()
        }
        return cls(layout, rank, boxes)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.boxes.values() for t in ts)

    def take(self, state: ShardedState) -> None:
        """Copy every box of `state` (which must be this copy's layout and rank) to the host."""
        if (
            state.layout != self.layout
            or state.rank != self.rank
            or set(state.boxes) != set(self.boxes)
        ):
            raise InvalidInput(
                f"the old state given to the switch is rank {state.rank} of "
                f"{state.layout.describe()}; the reconfiguration was prepared for rank "
                f"{self.rank} of {self.layout.describe()}"
            )
        for ref, held in state.boxes.items():
            for (_, tensor), host in zip(held, self.boxes[ref], strict=True):
                host.copy_(tensor, non_blocking=True)
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)


@dataclass
class _OldStorage:
    """One device storage of the old state and the boxes that live in it."""

    storage: torch.UntypedStorage
    nbytes: int
    boxes: list[tuple[TensorRef, int]]
    last_use: int  # the last round that reads it (-1: none; len(rounds): after the last one)
    releasable: bool
    alive: bool = True


class Bounded:
    """The bounded mode's `executor.Storage`: reads old boxes from the device while they are
    there and from the host copy after; allocates new boxes as they are first written."""

    def __init__(
        self,
        program: Program,
        *,
        spec: ModelSpec,
        old: ShardedState | None,
        host: HostCopy | None,
        new: Layout,
        new_rank: int | None,
        new_boxes: dict[TensorRef, list[Box]],
        device: torch.device,
        memory: Memory,
    ) -> None:
        self.program, self.spec, self.old, self.host = program, spec, old, host
        self.new, self.new_rank, self.new_boxes = new, new_rank, new_boxes
        self.device, self.memory = device, memory
        self.targets: dict[tuple[TensorRef, int], torch.Tensor] = {}
        self.landings: dict[tuple[int, int], torch.Tensor] = {}
        old_bytes = old.nbytes if old is not None else 0
        new_bytes = sum(
            _volume_bytes(spec, ref, box) for ref, boxes in new_boxes.items() for box in boxes
        )
        self.limit = max(old_bytes, new_bytes)  # device bytes of old and new state together
        self.resident = old_bytes
        self._pending: dict[int, list[NewBox]] = {}  # by the round of their first receive
        self._last: list[NewBox] = []  # local copies only: filled after the last round
        kept: list[NewBox] = []
        for nb in program.new_boxes:
            if nb.kept:
                kept.append(nb)
            elif nb.first_round is None:
                self._last.append(nb)
            else:
                self._pending.setdefault(nb.first_round, []).append(nb)
        self._copies: dict[tuple[TensorRef, int], list[LocalCopy]] = {}
        whole: dict[tuple[TensorRef, int], int] = {}
        for c in program.local:
            if c.whole:
                whole[(c.ref, c.target.index)] = c.source.index
            else:
                self._copies.setdefault((c.ref, c.target.index), []).append(c)
        self._storages: list[_OldStorage] = []
        self._storage_of: dict[tuple[TensorRef, int], _OldStorage] = {}
        if old is not None:
            self._group_storages(old)
            for nb in kept:  # passed on as the very same tensor
                self.targets[(nb.ref, nb.index)] = old.boxes[nb.ref][whole[(nb.ref, nb.index)]][1]
                box = new_boxes[nb.ref][nb.index]
                memory.kept += _volume_bytes(spec, nb.ref, box)
        self._release(lambda s: s.last_use < 0)  # never read: given back at once

    def _group_storages(self, old: ShardedState) -> None:
        uses = {(ob.ref, ob.index): ob for ob in self.program.old_boxes}
        by_pointer: dict[int, _OldStorage] = {}
        spans: dict[int, list[tuple[int, int]]] = {}
        for ref, held in old.boxes.items():
            for i, (_, tensor) in enumerate(held):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                use = uses[(ref, i)]
                last = -1 if use.last_round is None else use.last_round
                entry = by_pointer.get(key)
                if entry is None:
                    entry = _OldStorage(storage, storage.nbytes(), [], last, True)
                    by_pointer[key] = entry
                    self._storages.append(entry)
                entry.boxes.append((ref, i))
                entry.last_use = max(entry.last_use, last)
                entry.releasable &= (
                    not use.kept and tensor.is_contiguous() and tensor.device == self.device
                )
                start = int(tensor.storage_offset()) * tensor.element_size()
                spans.setdefault(key, []).append((start, start + _tensor_bytes(tensor)))
                self._storage_of[(ref, i)] = entry
        for key, entry in by_pointer.items():
            entry.releasable &= entry.storage.resizable() and _tiles(spans[key], entry.nbytes)

    # ---- executor.Storage ----

    def source(self, ref: TensorRef, index: int) -> torch.Tensor:
        entry = self._storage_of.get((ref, index))
        if entry is not None and entry.alive:
            assert self.old is not None
            return self.old.boxes[ref][index][1]
        assert self.host is not None
        return self.host.boxes[ref][index]

    def target(self, ref: TensorRef, index: int) -> torch.Tensor:
        return self.targets[(ref, index)]

    def landing(self, round_: int, index: int) -> torch.Tensor | None:
        return self.landings.pop((round_, index), None)

    def before_round(self, round_: int, drain: Callable[[], None]) -> None:
        due = self._pending.pop(round_, [])
        need = sum(self._nbytes(nb) for nb in due)
        if self.resident + need > self.limit:
            # Room must come from storage that pending sends may still be reading: let them end.
            drain()
        # Boxes received whole in one packed message live in the block it lands in.
        for i, message in enumerate(self.program.rounds[round_].messages):
            if message.lands_in_place:
                self._make_room(message.nbytes)
                block = torch.empty(message.nbytes, dtype=torch.uint8, device=self.device)
                self._allocated(message.nbytes)
                self.landings[(round_, i)] = block
                for ref, index, tensor in landing_views(self.spec, message, block):
                    self.targets[(ref, index)] = tensor
        for nb in due:
            if (nb.ref, nb.index) not in self.targets:
                self._fill(nb)

    def after_round(self, round_: int) -> None:
        self._release(lambda s: s.last_use <= round_)

    def finish(self) -> None:
        for round_ in sorted(self._pending):  # (none: every such round posts its receives)
            for nb in self._pending.pop(round_):
                self._fill(nb)
        for nb in self._last:
            self._fill(nb)
        self._last = []
        self._release(lambda s: True)

    # ---- the shadow, and the way back ----

    def state(self) -> ShardedState | None:
        """The new state, once `finish` has run (None for a member that leaves)."""
        if self.new_rank is None:
            return None
        boxes = {
            ref: [(box, self.targets[(ref, i)]) for i, box in enumerate(held)]
            for ref, held in self.new_boxes.items()
        }
        return ShardedState(self.spec, self.new, self.new_rank, self.device, boxes)

    def abort(self) -> None:
        """Drop the shadow and restore every storage given back from the host copy."""
        self.targets.clear()
        self.landings.clear()
        restored = [s for s in self._storages if not s.alive]
        for entry in restored:
            entry.storage.resize_(entry.nbytes)
            entry.alive = True
            for ref, i in entry.boxes:
                assert self.old is not None and self.host is not None
                self.old.boxes[ref][i][1].copy_(self.host.boxes[ref][i], non_blocking=True)
        if restored and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- internals ----

    def _nbytes(self, nb: NewBox) -> int:
        return _volume_bytes(self.spec, nb.ref, self.new_boxes[nb.ref][nb.index])

    def _fill(self, nb: NewBox) -> None:
        """Allocate new box `nb` (making room first) and make its local copies."""
        box = self.new_boxes[nb.ref][nb.index]
        nbytes = self._nbytes(nb)
        self._make_room(nbytes)
        dtype = TORCH_DTYPES[self.spec.dtype(nb.ref.kind)]
        tensor = torch.empty(box_shape(box), dtype=dtype, device=self.device)
        self._allocated(nbytes)
        self.targets[(nb.ref, nb.index)] = tensor
        copies = self._copies.pop((nb.ref, nb.index), [])
        backend.copy_all(
            [view(tensor, c.target) for c in copies],
            [view(self.source(c.ref, c.source.index), c.source) for c in copies],
        )

    def _allocated(self, nbytes: int) -> None:
        self.resident += nbytes
        self.memory.allocate(nbytes)

    def _make_room(self, nbytes: int) -> None:
        """Give back old storage, the one read latest first, until `nbytes` more fit."""
        candidates = sorted(
            (s for s in self._storages if s.alive and s.releasable), key=lambda s: -s.last_use
        )
        for entry in candidates:
            if self.resident + nbytes <= self.limit:
                return
            self._give_back(entry)

    def _release(self, due: Callable[[_OldStorage], bool]) -> None:
        for entry in self._storages:
            if entry.alive and entry.releasable and due(entry):
                self._give_back(entry)

    def _give_back(self, entry: _OldStorage) -> None:
        if self.device.type == "cuda":
            # Sends and copies queued on the stream may still read it.
            torch.cuda.current_stream(self.device).synchronize()
        entry.storage.resize_(0)
        entry.alive = False
        self.resident -= entry.nbytes
        self.memory.release(entry.nbytes)


class BoundedMemory:
    """The bounded mode's part of one switch (`executor.SwitchMemory`)."""

    sends_need_buffers = True  # an old box's storage may be given back while its send waits

    def __init__(self, side: SwitchSide) -> None:
        self.side = side
        self._program: Program | None = None
        self._new_boxes: dict[TensorRef, list[Box]] = {}
        self._host: HostCopy | None = None
        self._bounded: Bounded | None = None

    @property
    def shadow(self) -> ShardedState | None:
        return None  # allocated box by box at the switch

    def prepare(self, program: Program, new_boxes: dict[TensorRef, list[Box]]) -> None:
        self._program, self._new_boxes = program, new_boxes
        side = self.side
        if side.old_rank is not None:
            self._host = HostCopy.allocate(side.spec, side.old, side.old_rank, side.device)

    def release(self) -> None:
        self._host = None

    def storage(
        self,
        old: ShardedState | None,
        memory: Memory,
        seconds: dict[str, float],
        read_old: Callable[[], None] | None,
    ) -> tuple[Storage, Callable[[], object] | None]:
        """The old state goes to the host copy first: its device storage may be given back
        from then on, so `read_old` runs before."""
        assert self._program is not None, "prepare comes first"
        side, host = self.side, self._host
        self._host = None
        if host is not None:
            memory.host = host.nbytes
        if read_old is not None:
            read_old()
        start = time.perf_counter()
        if old is not None:
            if host is None:
                raise ValueError(
                    f"epoch {side.epoch}: {side.member} has an old state but no host copy: it "
                    "was not a member of the old layout when prepared"
                )
            host.take(old)
        seconds["host_copy"] = time.perf_counter() - start
        self._bounded = Bounded(
            self._program, spec=side.spec, old=old, host=host, new=side.new,
            new_rank=side.new_rank, new_boxes=self._new_boxes, device=side.device, memory=memory,
        )  # fmt: skip
        return self._bounded, None

    def new_state(self) -> ShardedState | None:
        assert self._bounded is not None, "the storage comes first"
        return self._bounded.state()

    def abort(self, seconds: dict[str, float]) -> None:
        """Restore the old state's storage from the host copy (if any was given back)."""
        bounded, self._bounded = self._bounded, None
        if bounded is not None:
            start = time.perf_counter()
            bounded.abort()
            seconds["restore"] = time.perf_counter() - start


def _volume_bytes(spec: ModelSpec, ref: TensorRef, box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n * spec.dtype(ref.kind).itemsize


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tiles(spans: list[tuple[int, int]], nbytes: int) -> bool:
    """Whether the byte ranges `spans` cover `[0, nbytes)` exactly, without overlap."""
    at = 0
    for start, stop in sorted(spans):
        if start != at:
            return False
        at = stop
    return at == nbytes
