"""Member assignment: which surviving member takes which new rank, to move the fewest bytes.

- `overlap`: the bytes each old member already holds of each new rank's region, compactly;
- `solver`: an exact rectangular assignment solver (shortest augmenting paths, int64 costs);
- `assign`: the best and the in-order assignment of a change, with a lower bound.
"""
