"""Members on nodes: the two holders of each mirrored byte on different nodes.

A mirrored layout (`Layout.mirror`) holds each ZeRO shard on a member of its shard group and on
the next one, round, and a box no replica holds on its holder and its peer, so a member's death
loses no byte. A node's loss kills every member on it: it loses a byte when both of its holders
were there. Who neighbours whom is the layout's member order, so `spread` orders the members a
change is free to place (a first layout's, a change's joiners) to put as few *mirror pairs* (two
members holding copies of one box) on one node as it can, and keeps a tensor-parallel group on
one node where that costs no pair.

Method: the free ranks are filled in rank order, each with a member of the node that has the
most members left among the nodes none of its already placed partners is on (a tp group's
node first); then exchanges of two free ranks' members that lower the count are made while
there are any (a local search: not proven minimal with fixed members, but minimal on a ring of
free ranks, `2 * largest - n` pairs at least when one node has more than half the members).
`respread` runs that search alone on a world in effect, every rank free. When more pods are
ready than a change uses, `balanced` says which to take first: those on the least crowded nodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from ..layout.layout import Degrees, Layout

_SWAP_PASSES = 4


def mirror_pairs(shape: Layout | Degrees) -> list[tuple[int, int]]:
    """The pairs of ranks that hold a box and its mirror's copy under `shape` (`Layout.mirror`):
    neighbours in each ZeRO shard group (a stage's and tp index's dp ranks; with ep > 1, each
    expert group too), and a box's holder and its peer where no replica holds it (dp = 1: along
    pp, else tp; experts of ep = dp: along dp); none when it is not mirrored."""
    if not shape.mirror:
        return []
    dp, tp, pp, ep = shape.dp, shape.tp, shape.pp, shape.ep
    groups: list[range] = []
    if shape.zero > 0:
        groups = [range(dp), *(range(o, dp, ep) for o in range(ep) if ep > 1)]
    peer = None  # the (pp, dp, tp) offset from a box held once to its copy (`region.place`)
    if dp == 1 or ep == dp:
        peer = (0, 1, 0) if dp > 1 else (1, 0, 0) if pp > 1 else (0, 0, 1)
    pairs: set[tuple[int, int]] = set()

    def add(s: int, d: int, t: int, step: tuple[int, int, int]) -> None:
        a = (s * dp + d) * tp + t
        b = (((s + step[0]) % pp) * dp + (d + step[1]) % dp) * tp + (t + step[2]) % tp
        if a != b:
            pairs.add((min(a, b), max(a, b)))

    for s in range(pp):
        for t in range(tp):
            for group in (g for g in groups if len(g) > 1):
                for i, d in enumerate(group):
                    add(s, d, t, (0, group[(i + 1) % len(group)] - d, 0))
            if peer is not None:
                for d in range(dp):
                    add(s, d, t, peer)
    return sorted(pairs)


def pairs_on_one_node(
    shape: Layout | Degrees, members: Sequence[str], node_of: Mapping[str, str]
) -> int:
    """How many mirror pairs of `members` (in rank order) share a known node."""
    nodes = [node_of.get(m, "") for m in members]
    return sum(1 for a, b in mirror_pairs(shape) if nodes[a] and nodes[a] == nodes[b])


def spread(
    shape: Layout | Degrees,
    members: Sequence[str],
    fixed: Collection[str],
    node_of: Mapping[str, str],
) -> list[str]:
    """`members` (in rank order) with those not in `fixed` reordered among their ranks so that
    few mirror pairs share a node (module docstring). Members of no known node count as one
    node each; among equal choices the given order is kept."""
    pairs = mirror_pairs(shape)
    free = [r for r, m in enumerate(members) if m not in fixed]
    if not pairs or len(free) < 2:
        return list(members)
    partners = _partners(pairs, len(members))
    node = [_node(node_of, m) for m in members]
    out: list[str | None] = [None if r in free else m for r, m in enumerate(members)]
    at: list[str | None] = [None if r in free else node[r] for r in range(len(members))]
    waiting: dict[str, list[str]] = {}
    for r in free:
        waiting.setdefault(node[r], []).append(members[r])
    left = Counter({n: len(ms) for n, ms in waiting.items()})  # nodes in order of first rank
    for r in free:
        taken = {at[p] for p in partners[r]}
        allowed = [n for n in left if left[n] and n not in taken]
        group_node = at[r - 1] if r % shape.tp else None  # the tp group's node so far
        if group_node in allowed:
            pick = group_node
        else:
            pick = max(allowed or [n for n in left if left[n]], key=left.__getitem__)
        assert pick is not None
        left[pick] -= 1
        out[r], at[r] = waiting[pick].pop(0), pick
    placed = [m for m in out if m is not None]
    _improve(placed, [n for n in at if n is not None], free, partners)
    return placed


def balanced(
    candidates: Sequence[str], node_of: Mapping[str, str], placed: Sequence[str] = ()
) -> list[str]:
    """`candidates` in the order to take them so that any first few of them, with `placed`,
    crowd their nodes the least: each next one from the node with the fewest members so far
    (placed or taken), the given order among equals; members of no known node count as one node
    each. Which pods a change uses when more are ready than it needs."""
    count = Counter(_node(node_of, m) for m in placed)
    waiting: dict[str, list[str]] = {}
    for m in candidates:
        waiting.setdefault(_node(node_of, m), []).append(m)
    out: list[str] = []
    while waiting:
        pick = min(waiting, key=count.__getitem__)
        out.append(waiting[pick].pop(0))
        count[pick] += 1
        if not waiting[pick]:
            del waiting[pick]
    return out


def respread(
    shape: Layout | Degrees, members: Sequence[str], node_of: Mapping[str, str]
) -> list[str]:
    """`members` (in rank order, every one on a known node) after the exchanges of two members
    that lower the mirror pairs on one node: `spread`'s local search from the order in effect,
    every rank free, so that most members keep their rank and their state. For a world whose
    survivors were kept where they were while pairs came to share a node."""
    pairs = mirror_pairs(shape)
    if not pairs or not all(node_of.get(m) for m in members):
        return list(members)
    partners = _partners(pairs, len(members))
    out = list(members)
    _improve(out, [node_of[m] for m in members], list(range(len(members))), partners)
    return out


def _node(node_of: Mapping[str, str], member: str) -> str:
    """`member`'s node; one of its own when it is not known."""
    return node_of.get(member) or f"\0{member}"


def _partners(pairs: list[tuple[int, int]], n: int) -> list[list[int]]:
    """Each of `n` ranks' partners in `pairs`."""
    out: list[list[int]] = [[] for _ in range(n)]
    for a, b in pairs:
        out[a].append(b)
        out[b].append(a)
    return out


def _improve(
    members: list[str], nodes: list[str], free: list[int], partners: list[list[int]]
) -> None:
    """Exchange two free ranks' members (in place) while an exchange lowers the pairs on one
    node."""

    def bad(r: int, n: str) -> int:
        return sum(nodes[p] == n for p in partners[r])

    for _ in range(_SWAP_PASSES):
        changed = False
        for r in free:
            if not bad(r, nodes[r]):
                continue
            for s in free:
                if nodes[s] == nodes[r]:
                    continue
                before = bad(r, nodes[r]) + bad(s, nodes[s])
                nodes[r], nodes[s] = nodes[s], nodes[r]
                after = bad(r, nodes[r]) + bad(s, nodes[s])
                if after < before:
                    members[r], members[s] = members[s], members[r]
                    changed = True
                    break
                nodes[r], nodes[s] = nodes[s], nodes[r]
        if not changed:
            return
