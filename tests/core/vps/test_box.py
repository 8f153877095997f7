"""Box operations and `torch.chunk`-style splitting."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.vps.box import (
    chunk,
    full_box,
    intersect,
    is_empty,
    replace_dim,
    split_rows,
    volume,
)


def test_full_box_and_volume() -> None:
    assert full_box((3, 4)) == ((0, 3), (0, 4))
    assert volume(full_box((3, 4))) == 12  # 3 * 4
    assert volume(((2, 5), (1, 3))) == 6  # (5 - 2) * (3 - 1)
    assert volume(((2, 2), (0, 7))) == 0
    assert volume(((5, 2),)) == 0  # a reversed interval counts as empty, not negative


def test_is_empty() -> None:
    assert is_empty(((3, 3), (0, 4)))
    assert is_empty(((0, 4), (6, 5)))
    assert not is_empty(((0, 1), (0, 1)))


def test_intersect() -> None:
    a = ((0, 4), (2, 6))
    b = ((2, 8), (0, 3))
    assert intersect(a, b) == ((2, 4), (2, 3))
    assert intersect(b, a) == ((2, 4), (2, 3))
    # Touching boxes do not overlap: intervals are half-open.
    assert intersect(((0, 2),), ((2, 4),)) is None
    # Overlap on one dimension only is no overlap.
    assert intersect(((0, 4), (0, 2)), ((1, 3), (2, 5))) is None
    with pytest.raises(ValueError):
        intersect(((0, 1),), ((0, 1), (0, 1)))  # different ranks of tensors


def test_replace_dim() -> None:
    box = ((0, 4), (0, 6), (1, 2))
    assert replace_dim(box, 1, (2, 3)) == ((0, 4), (2, 3), (1, 2))
    assert replace_dim(box, 0, (1, 2)) == ((1, 2), (0, 6), (1, 2))
    assert replace_dim(box, 2, (0, 9)) == ((0, 4), (0, 6), (0, 9))


@pytest.mark.parametrize(
    ("length", "parts", "expected"),
    [
        # ceil(5/4) = 2: chunks of 2 from the start, then what is left, then empty.
        (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
        # ceil(6/4) = 2: 2, 2, 2 and one empty trailing chunk (torch.chunk returns 3 chunks).
        (6, 4, [(0, 2), (2, 4), (4, 6), (6, 6)]),
        # ceil(64/3) = 22: 22, 22, 20.
        (64, 3, [(0, 22), (22, 44), (44, 64)]),
        # ceil(3/4) = 1: 1, 1, 1, 0.
        (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]),
        # ceil(1/3) = 1: only the first chunk is non-empty.
        (1, 3, [(0, 1), (1, 1), (1, 1)]),
        # even split.
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (7, 1, [(0, 7)]),
        # ceil(10/4) = 3: 3, 3, 3, 1.
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    ],
)
def test_chunk_matches_torch_chunk_by_hand(
    length: int, parts: int, expected: list[tuple[int, int]]
) -> None:
    assert [chunk(length, parts, i) for i in range(parts)] == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(1, 40))
def test_chunk_properties(length: int, parts: int) -> None:
    intervals = [chunk(length, parts, i) for i in range(parts)]
    size = -(-length // parts)
    # Consecutive, starting at 0 and ending at length: a partition of [0, length).
    assert intervals[0][0] == 0
    assert intervals[-1][1] == length
    for (_, stop), (start, _) in itertools.pairwise(intervals):
        assert stop == start
    sizes = [b - a for a, b in intervals]
    assert all(0 <= n <= size for n in sizes)
    # torch.chunk: every non-empty chunk but the last non-empty one has exactly ceil(n/k) rows.
    nonempty = [n for n in sizes if n]
    assert all(n == size for n in nonempty[:-1])
    # Empty chunks only trail.
    first_empty = next((i for i, n in enumerate(sizes) if n == 0), parts)
    assert all(n == 0 for n in sizes[first_empty:])


@pytest.mark.parametrize(("parts", "index"), [(0, 0), (-1, 0), (3, 3), (3, -1)])
def test_chunk_rejects_bad_index(parts: int, index: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        chunk(10, parts, index)


def test_split_rows() -> None:
    box = ((3, 10), (0, 4))
    # 7 rows cut by 3: [3,6), [6,9), [9,10).
    assert split_rows(box, 3) == [((3, 6), (0, 4)), ((6, 9), (0, 4)), ((9, 10), (0, 4))]
    assert split_rows(box, 7) == [box]
    assert split_rows(box, 100) == [box]
    assert split_rows(((2, 2), (0, 4)), 3) == []
    with pytest.raises(ValueError, match="max_rows"):
        split_rows(box, 0)
