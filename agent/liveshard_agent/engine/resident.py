"""The resident memory mode (`modes.MemoryMode.RESIDENT`): the whole shadow allocated in prepare,
the old state read where it is and never touched.

`ResidentMemory` is the mode's `executor.SwitchMemory`: it lays the shadow out in prepare (with
the blocks packed messages land in, `shadow.allocate_shadow`), and at the switch gives the
executor a `Resident` storage whose local copies, and a whole-state read of the old state, run
while the first round is in flight. An abort drops the shadow; the old state was never written.
This module must not decide whether a switch commits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from liveshard_core.vps.box import Box
from liveshard_core.vps.spec import TensorRef

from . import backend
from .executor import Memory, Storage, SwitchSide, view
from .program import Program
from .shadow import allocate_shadow
from .state import ShardedState


class Resident:
    """The resident mode's `executor.Storage`: the old state as it is, the shadow allocated in
    prepare (with the blocks its packed messages land in); the local copies run while the first
    round is in flight (`copy_local`)."""

    def __init__(
        self,
        program: Program,
        old: ShardedState | None,
        shadow: ShardedState | None,
        landings: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        self.program, self.old, self.shadow, self.landings = program, old, shadow, landings

    def source(self, ref: TensorRef, index: int) -> torch.Tensor:
        assert self.old is not None
        return self.old.boxes[ref][index][1]

    def target(self, ref: TensorRef, index: int) -> torch.Tensor:
        assert self.shadow is not None
        return self.shadow.boxes[ref][index][1]

    def landing(self, round_: int, index: int) -> torch.Tensor | None:
        return self.landings.get((round_, index))

    def copy_local(self) -> None:
        local = self.program.local
        backend.copy_all(
            [view(self.target(c.ref, c.target.index), c.target) for c in local],
            [view(self.source(c.ref, c.source.index), c.source) for c in local],
        )

    def before_round(self, round_: int, drain: Callable[[], None]) -> None:
        pass

    def after_round(self, round_: int) -> None:
        pass

    def finish(self) -> None:
        pass


class ResidentMemory:
    """The resident mode's part of one switch (`executor.SwitchMemory`)."""

    sends_need_buffers = False  # the old state stays on the device: sends read it in place

    def __init__(self, side: SwitchSide) -> None:
        self.side = side
        self._program: Program | None = None
        self._shadow: ShardedState | None = None
        self._landings: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def shadow(self) -> ShardedState | None:
        return self._shadow

    def prepare(self, program: Program, new_boxes: dict[TensorRef, list[Box]]) -> None:
        self._program = program
        side = self.side
        if side.new_rank is not None:  # zeroed: every page touched before the pause
            laid_out = allocate_shadow(side.spec, side.new, side.new_rank, side.device, program)
            self._shadow, self._landings = laid_out.state, laid_out.landings

    def release(self) -> None:
        shadow, self._shadow, self._landings = self._shadow, None, {}
        if shadow is not None:
            shadow.release()

    def storage(
        self,
        old: ShardedState | None,
        memory: Memory,
        seconds: dict[str, float],
        read_old: Callable[[], None] | None,
    ) -> tuple[Storage, Callable[[], object] | None]:
        assert self._program is not None, "prepare comes first"
        if self._shadow is not None:
            memory.allocate(self._shadow.nbytes)  # held since prepare
        landings, self._landings = self._landings, {}
        resident = Resident(self._program, old, self._shadow, landings)

        def overlap() -> None:  # reads the old state only: while round 0 is in flight
            resident.copy_local()
            if read_old is not None:
                read_old()

        return resident, overlap

    def new_state(self) -> ShardedState | None:
        return self._shadow

    def abort(self, seconds: dict[str, float]) -> None:
        self.release()
