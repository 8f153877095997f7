"""An exact rectangular assignment solver: shortest augmenting paths with dual potentials.

`min_cost_assignment` gives every row one distinct column so that the summed cost is minimal
(rows <= columns). It is the Hungarian method in its shortest-augmenting-path form (Jonker and
Volgenant; the O(n^2 m) variant of e-maxx): rows are added one at a time, each by a Dijkstra
search over the columns on reduced costs `cost - u - v`; the potentials `u`, `v` stay dual
feasible and tight on the matching, which is what proves the result optimal (LP duality of the
assignment polytope). Costs are integers (int64), so the result is exact, not approximate.

Rows are fetched through a callback, so a caller can build them on demand instead of holding a
rows x columns matrix. Each scan is a handful of numpy operations over the columns. A row with a
free column among its cheapest when all rows are first looked at takes it there (row reduction,
as in Jonker and Volgenant's initialisation); only the others are searched, and a search ends as
soon as a free column is among the nearest (costs often tie: members hold the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]

_INF = np.iinfo(np.int64).max // 4


def min_cost_assignment(rows: int, cols: int, row_cost: Callable[[int], Ints]) -> Ints:
    """For each row, its column in a minimum-cost assignment; `row_cost(i)` is row i's costs.

    Costs must stay well inside int64 (their magnitudes times the number of rows under 2**60).
    """
    if rows > cols:
        raise ValueError(f"{rows} rows cannot take distinct columns among {cols}")
    u = np.zeros(rows, dtype=np.int64)
    v = np.zeros(cols, dtype=np.int64)
    owner = np.full(cols, -1, dtype=np.int64)
    way = np.zeros(cols, dtype=np.int64)  # the previous column on the path; -1: the start
    used = np.zeros(cols, dtype=np.int64)  # columns scanned in this search, in order
    # Row reduction: a row with a free column among its cheapest takes it, with its potential at
    # that cost; every reduced cost stays non-negative and the pair is tight, so it needs no search.
    searched = []
    for i in range(rows):
        cost = row_cost(i)
        open_cost = np.where(owner < 0, cost, _INF)
        j = int(np.argmin(open_cost))
        if open_cost[j] == cost.min():
            owner[j], u[i] = i, cost[j]
        else:
            searched.append(i)
    for i in searched:
        # The search starts at row i; minv holds each column's tentative distance, and a column
        # once scanned is pushed to _INF so that argmin never picks it again.
        minv = np.full(cols, _INF, dtype=np.int64)
        free = np.ones(cols, dtype=bool)
        n_used = 0
        i0, j0 = i, -1
        u_start = 0  # u[i] grows by every delta while row i is the search's root
        while True:
            cur = row_cost(i0) - (u[i0] if i0 != i else u_start) - v
            better = cur < minv
            better &= free
            minv[better] = cur[better]
            way[better] = j0
            j1 = int(np.argmin(minv))
            delta = minv[j1]
            if owner[j1] >= 0:  # among the nearest columns, a free one ends the search now
                nearest_free = np.flatnonzero((minv == delta) & (owner < 0))
                if len(nearest_free):
                    j1 = int(nearest_free[0])
            u_start += delta
            if n_used:
                scanned = used[:n_used]
                u[owner[scanned]] += delta
                v[scanned] -= delta
            minv -= delta
            if owner[j1] < 0:
                break
            free[j1] = False
            minv[j1] = _INF
            used[n_used] = j1
            n_used += 1
            i0, j0 = int(owner[j1]), j1
        u[i] = u_start
        while j1 >= 0:
            j0 = int(way[j1])
            owner[j1] = owner[j0] if j0 >= 0 else i
            j1 = j0
    out = np.full(rows, -1, dtype=np.int64)
    taken = np.nonzero(owner >= 0)[0]
    out[owner[taken]] = taken
    return out
