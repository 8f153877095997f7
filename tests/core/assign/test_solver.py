"""The assignment solver against brute force, on small matrices with ties and negative costs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.assign.solver import min_cost_assignment


@st.composite
def matrices(draw: st.DrawFn) -> np.ndarray:
    rows = draw(st.integers(1, 5))
    cols = draw(st.integers(rows, 6))
    values = st.integers(-4, 4) if draw(st.booleans()) else st.integers(-(10**9), 10**9)
    cells = draw(st.lists(values, min_size=rows * cols, max_size=rows * cols))
    return np.array(cells, dtype=np.int64).reshape(rows, cols)


@settings(max_examples=300, deadline=None)
@given(matrices())
def test_optimal_against_brute_force(cost: np.ndarray) -> None:
    rows, cols = cost.shape
    chosen = min_cost_assignment(rows, cols, lambda i: cost[i].copy())
    assert len(set(chosen.tolist())) == rows and all(0 <= c < cols for c in chosen)
    best = min(
        sum(int(cost[i, c]) for i, c in enumerate(perm))
        for perm in itertools.permutations(range(cols), rows)
    )
    assert sum(int(cost[i, c]) for i, c in enumerate(chosen)) == best


def test_more_rows_than_columns_is_an_error() -> None:
    with pytest.raises(ValueError, match="distinct columns"):
        min_cost_assignment(3, 2, lambda i: np.zeros(2, dtype=np.int64))
