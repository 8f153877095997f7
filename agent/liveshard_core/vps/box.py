"""Boxes of a logical tensor's global index space and `torch.chunk`-style splitting.

A box is a tuple of half-open `(start, stop)` intervals, one per dimension. Boxes are plain tuples
(hashable, cheap to build by the hundred thousand); the functions here are the only operations on
them.
"""

from __future__ import annotations

from math import prod

from ..errors import InvalidInput

Interval = tuple[int, int]
Box = tuple[Interval, ...]


def full_box(shape: tuple[int, ...]) -> Box:
    """The box covering a whole tensor of `shape`."""
    return tuple((0, n) for n in shape)


def volume(box: Box) -> int:
    """Number of elements in `box` (0 for an empty box)."""
    return prod(max(0, stop - start) for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of a tensor holding `box`."""
    return tuple(stop - start for start, stop in box)


def is_empty(box: Box) -> bool:
    return any(stop <= start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None when they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def replace_dim(box: Box, dim: int, interval: Interval) -> Box:
    """`box` with its interval on `dim` replaced."""
    return (*box[:dim], interval, *box[dim + 1 :])


def chunk(length: int, parts: int, index: int) -> Interval:
    """Interval of chunk `index` when `length` is split into `parts` like `torch.chunk`.

    Every chunk has `ceil(length / parts)` elements except the last non-empty one; trailing chunks
    may be empty (torch.chunk then returns fewer chunks; here they are empty intervals).
    """
    if parts <= 0 or not 0 <= index < parts:
        raise InvalidInput(f"chunk index {index} out of range for {parts} parts")
    size = -(-length // parts)
    start = min(index * size, length)
    return (start, min(start + size, length))


def split_rows(box: Box, max_rows: int) -> list[Box]:
    """Cut `box` along dim 0 into consecutive boxes of at most `max_rows` rows."""
    if max_rows < 1:
        raise InvalidInput(f"max_rows must be at least 1, got {max_rows}")
    start, stop = box[0]
    return [
        replace_dim(box, 0, (row, min(row + max_rows, stop)))
        for row in range(start, stop, max_rows)
    ]
