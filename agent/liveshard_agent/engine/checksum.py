"""The checksum formats: of whole training state, and of the bytes a switch moves.

`Checksums` (the whole-state check, `Verification.STATE`): the checksum of a logical tensor is,
over disjoint boxes, the sum of (sum of the elements' bit patterns, row-weighted sum,
column-weighted sum), modulo 2**(8 * element size). Each box is counted by its lowest-ranked
holder only, so summed over every rank of any layout the total is the same: the switch all-reduces
the old layout's and the new layout's checksums and compares them. A value that is lost, changed
or moved to another row or column changes the total. Sums accumulate, wrapping, in the integer
type of the element's own width, which keeps them at memory speed.

`MovedSums` (`Verification.MOVED`): the checksums of the bytes that cross the network, computed by
the sender as it sends each message and by the receiver as each one arrives, so that the cost
follows the bytes moved and hides behind the transfer. Summed per receiving member over the union,
what was sent to a member and what it received must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liveshard_core.layout.region import partition
from liveshard_core.vps.box import Box
from liveshard_core.vps.spec import ModelSpec, TensorRef

from .program import Message, Program
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


class MovedSums:
    """Checksums of one member's messages, filled as they are sent and received.

    A message's words are its elements' bit patterns (a single piece, viewed as its dim-0 rows)
    or the int32 words of a packed buffer (int16 when its length is not a multiple of 4), viewed
    as one row. Each row is summed, wrapping, in the words' own width: one pass at memory speed,
    into a row buffer laid out in prepare, so that a message costs one operation. `totals` then
    weights each row sum by its row number (catching rows moved within a message) and adds them up
    per receiving member: sums of what was sent to each member, and of what each received.
    """

    def __init__(self, program: Program, slots: int, device: torch.device) -> None:
        self.slot, self.slots, self.device = program.slot, slots, device
        rows: dict[bool, tuple[list[int], list[int]]] = {False: ([], []), True: ([], [])}
        self._at: dict[tuple[int, int], tuple[bool, int, int]] = {}
        for r, round_ in enumerate(program.rounds):
            for i, message in enumerate(round_.messages):
                wide, count = _words(message)
                owner = message.peer if message.send else program.slot
                index, weight = rows[wide]
                self._at[(r, i)] = (wide, len(index), count)
                index += [(0 if message.send else slots) + owner] * count
                weight += range(1, count + 1)
        self._rows = {
            wide: torch.zeros(len(rows[wide][0]), dtype=_WORDS[wide], device=device)
            for wide in (False, True)
        }
        self._index = {
            wide: torch.tensor(rows[wide][0], dtype=torch.int64, device=device)
            for wide in (False, True)
        }
        self._weight = {
            wide: torch.tensor(rows[wide][1], dtype=torch.int64, device=device)
            for wide in (False, True)
        }

    def add(self, round_: int, index: int, buffer: torch.Tensor) -> None:
        """Sum the rows of message `index` of round `round_`, whose bytes are `buffer`
        (contiguous)."""
        wide, first, count = self._at[(round_, index)]
        words = buffer.view(_WORDS[wide]).view(count, -1)
        torch.sum(words, 1, dtype=words.dtype, out=self._rows[wide][first : first + count])

    def totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This member's share of the sums of what was sent to each member, and of what each
        member received: int64 [slots * 2] each (plain sum, row-weighted sum)."""
        out = torch.zeros((2 * self.slots, 2), dtype=torch.int64, device=self.device)
        for wide in (False, True):
            # The row sums as unsigned values of their width: exact from here on.
            values = self._rows[wide].to(torch.int64) & mask(_WORDS[wide].itemsize)
            out[:, 0].index_add_(0, self._index[wide], values)
            out[:, 1].index_add_(0, self._index[wide], values * self._weight[wide])
        sent, received = out.view(2, -1)
        return sent, received

    @staticmethod
    def differing(sent: torch.Tensor, received: torch.Tensor) -> list[int]:
        """The members (slots) whose received bytes differ from what was sent to them, given the
        `totals` added up over the union."""
        return (sent.view(-1, 2) != received.view(-1, 2)).any(dim=1).nonzero().flatten().tolist()


_WORDS = {False: torch.int16, True: torch.int32}


def _words(message: Message) -> tuple[bool, int]:
    """Whether a message's words are int32 (else int16), and how many rows it has."""
    if message.packed:
        return message.nbytes % 4 == 0, 1
    part = message.parts[0]
    rows = part.box[0][1] - part.box[0][0] if len(part.box) > 1 else 1
    return part.itemsize == 4, rows
