"""Matching one class of tensors: which holder sends which piece to which destination.

A class is every logical tensor with the same placement under the old and the new layout (say the
fp32 master of every `gate` in pipeline stage 3 that moves to stage 1); its pieces are computed
once and shared by all its tensors.

The rule. For every old box `j` and every new box `k` that overlaps it, the `i`-th holder of `k`
(in new rank order) gets `j & k`: by a local copy when it holds `j` itself; else, when live
holders of `j` share its pod (`union.Pods`: bytes inside a pod cross its devices' own links),
from number `(ord(j) + ord(k) + i) mod P` of those `P`; else from live holder number
`(ord(j) + ord(k) + i) mod H` of `j` (holders in old rank order; `H` live holders; `ord` is a
box's ordinal, `region.Geometry`). The sources rotate over the holders, so no holder sends to
more than `ceil(holders of k / H)` of `k`'s holders outside its pod, and the ordinals spread the
first turn over boxes. Every piece still comes from one holder, so the bytes between members stay
the lower bound; the pods only choose which holder.

Because the rule names a piece's source from `(j, k, i)` and the needer's pod alone, one member
finds its own pieces without the others' (`member_pieces`): what it receives from the boxes it
needs, and what it sends by stepping through the holders of each overlapping new box `H` at a
time (less those served in their pod) and through its own pod's members. Both walk the
partitions by arithmetic (`region.Geometry`), so a member's part costs what it holds, not the
number of ranks. Pieces are listed in the order of (old cell, new cell, `ord(j)`, `ord(k)`, `i`)
wherever they are computed (a cell: `region.Cell`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..layout.region import Holders, Placed
from ..vps.box import Box, intersect

if TYPE_CHECKING:
    from .union import Union


Slot = int
"""A member's position in a plan's union: the old members in old rank order, then the members
only the new layout has (see `plan.union`). Plans name members by slot, layouts by rank."""


class Piece(NamedTuple):
    """One box of one logical tensor moving from slot `src` to slot `dst`; `src == dst` is a
    local copy, anything else crosses the network."""

    src: Slot
    dst: Slot
    box: Box


class LostPiece(Exception):
    """A needed piece whose every holder is lost."""

    def __init__(self, box: Box) -> None:
        super().__init__(box)
        self.box = box


def pattern_pieces(union: Union, old: Placed, new: Placed) -> list[Piece]:
    """Every piece of the class placed `old` before and `new` after the change."""
    old_geometry, new_geometry = union.old_geometry(old), union.new_geometry(new)
    held_by, needed_by = union.cell_slots(old_geometry, new_geometry)
    out: list[tuple[Slot, Slot, Box]] = []
    for old_cell, new_cell, parts in union.pairs(old, new):
        sources, needers = held_by[old_cell], needed_by[new_cell]
        n = len(sources)
        if not n:
            raise LostPiece(parts[0][2])
        held = sources if n < 4 else set(sources)
        # Whom each needer takes from: its pod's holders when there are some, else all of them.
        choices = [sources] * len(needers)
        if near := union.near_by_pod(sources):
            pods = [union.pod_of(d) for d in needers]
            choices = [near.get(p, sources) if p else sources for p in pods]
        for j, k, part in parts:
            c = j + k
            out += [
                (d, d, part) if d in held else (choices[i][(c + i) % len(choices[i])], d, part)
                for i, d in enumerate(needers)
            ]
    return list(map(Piece._make, out))


def source(union: Union, dst: Slot, holders: Holders, c: int) -> Slot:
    """Who sends slot `dst` its piece `c` (`ord(j) + ord(k) + i`) of the box `holders` hold:
    a live holder in its pod when there is one, else any live holder."""
    near = union.near(dst, holders)
    if near:
        return near[c % len(near)]
    sources = union.sources(holders)
    return sources.slot(c % len(sources))


def member_pieces(
    union: Union, old: Placed, new: Placed, old_rank: int | None, new_rank: int | None
) -> list[Piece]:
    """The pieces the member at `old_rank` / `new_rank` (None: not in that layout; a lost member
    takes no part) copies, receives or sends, in the order `pattern_pieces` lists them."""
    old_geometry, new_geometry = union.old_geometry(old), union.new_geometry(new)
    keyed: list[tuple[tuple[int, int, int], Piece]] = []
    if new_rank is not None:
        me = union.new_slot(new_rank)
        for k, new_box, needers in new_geometry.of_rank(new_rank):
            i = needers.index(new_rank)
            assert i is not None
            for j, box, holders in old_geometry.overlapping(new_box):
                part = intersect(box, new_box)
                assert part is not None
                if old_rank is not None and holders.index(old_rank) is not None:
                    keyed.append(((j, k, i), Piece(me, me, part)))
                    continue
                if not len(union.sources(holders)):
                    raise LostPiece(part)
                keyed.append(((j, k, i), Piece(source(union, me, holders, j + k + i), me, part)))
    if old_rank is not None:
        me_old = union.old_slot(old_rank)
        assert me_old is not None
        pod = union.pod_new_ranks(me_old)
        for j, box, holders in old_geometry.of_rank(old_rank):
            sources = union.sources(holders)
            h, n = sources.position(old_rank), len(sources)
            for k, new_box, needers in new_geometry.overlapping(box):
                part = intersect(box, new_box)
                assert part is not None
                # Its turns in the rotation over every holder, and its own pod's members.
                turns = {(i, needers.rank(i)) for i in range((h - j - k) % n, len(needers), n)}
                turns |= {(i, d) for d in pod if (i := needers.index(d)) is not None}
                for i, dst in turns:
                    dst_old = union.old_rank_of_new(dst)
                    if dst_old is not None and holders.index(dst_old) is not None:
                        continue  # a holder of j (this member too) copies it itself
                    slot = union.new_slot(dst)
                    if source(union, slot, holders, j + k + i) == me_old:
                        keyed.append(((j, k, i), Piece(me_old, slot, part)))
    keyed.sort(
        key=lambda item: (
            item[0][0] // old_geometry.width,
            item[0][1] // new_geometry.width,
            *item[0],
        )
    )
    return [piece for _, piece in keyed]
