"""Members on nodes: the mirror pairs are the holders of each mirrored shard, and `spread` puts
the fewest of them on one node (brute force on small worlds), moving only the free members."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.assign.nodes import (
    balanced,
    mirror_pairs,
    pairs_on_one_node,
    respread,
    spread,
)
from liveshard_core.layout.layout import Degrees
from liveshard_core.layout.region import Geometry, place
from liveshard_core.vps.spec import ModelSpec
from tests.core.helpers import configs, degrees


def _holder_pairs(spec: ModelSpec, shape: Degrees) -> set[tuple[int, int]]:
    """From the layout's geometry: each box's holder without the mirror paired with a holder the
    mirror adds that differs from it along one axis (its shard group's next member, its peer)."""
    layout = shape.layout(spec, [str(i) for i in range(shape.world_size)])
    plain = dataclasses.replace(layout, mirror=False)
    out: set[tuple[int, int]] = set()
    for param in spec.params:
        for kind in spec.kinds:
            mirrored = Geometry(layout, place(spec, layout, param, kind))
            alone = Geometry(plain, place(spec, plain, param, kind))
            for cell in mirrored.cells():
                before = set(alone.holders(cell).ranks())
                for a in before:
                    for b in set(mirrored.holders(cell).ranks()) - before:
                        ca, cb = layout.coords(a), layout.coords(b)
                        if sum(x != y for x, y in zip(ca, cb, strict=True)) == 1:
                            out.add((min(a, b), max(a, b)))
    return out


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_mirror_pairs_are_the_two_holders_of_each_mirrored_shard(data: st.DataObject) -> None:
    spec = ModelSpec.from_config(data.draw(configs()))
    shape = data.draw(degrees(spec, 8))
    assert set(mirror_pairs(shape)) == _holder_pairs(spec, shape)


def test_mirror_pairs_by_hand() -> None:
    assert mirror_pairs(Degrees(dp=4, zero=1, mirror=True)) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert mirror_pairs(Degrees(dp=2, tp=2, zero=3, mirror=True)) == [(0, 2), (1, 3)]
    # Experts of ep=2 are sharded over dp ranks 0, 2 and 1, 3.
    ep = mirror_pairs(Degrees(dp=4, ep=2, zero=1, mirror=True))
    assert ep == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert mirror_pairs(Degrees(dp=4, zero=1)) == []
    # No replicas: each member and its peer along pp, else tp.
    assert mirror_pairs(Degrees(tp=2, pp=2, mirror=True)) == [(0, 2), (1, 3)]
    assert mirror_pairs(Degrees(tp=2, mirror=True)) == [(0, 1)]
    # Experts of ep = dp: along dp, where tp groups never are.
    assert mirror_pairs(Degrees(dp=2, ep=2, tp=2, mirror=True)) == [(0, 2), (1, 3)]
    assert mirror_pairs(Degrees(pp=3, mirror=True)) == [(0, 1), (0, 2), (1, 2)]


def _members_on_nodes(data: st.DataObject, nodes: str) -> tuple[Degrees, list[str], dict[str, str]]:
    """A random layout's members, each on one of `nodes`."""
    spec = ModelSpec.from_config(data.draw(configs()))
    shape = data.draw(degrees(spec, 7))
    members = [f"m{i}" for i in range(shape.world_size)]
    drawn = data.draw(st.lists(st.sampled_from(nodes), min_size=len(members),
                               max_size=len(members)))  # fmt: skip
    return shape, members, dict(zip(members, drawn, strict=True))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_spread_puts_the_fewest_mirror_pairs_on_one_node(data: st.DataObject) -> None:
    shape, members, node_of = _members_on_nodes(data, "abcd")
    fixed = set(data.draw(st.lists(st.sampled_from(members), unique=True)))
    out = spread(shape, members, fixed, node_of)
    assert sorted(out) == sorted(members)
    assert all(out[r] == m for r, m in enumerate(members) if m in fixed)
    free = [r for r, m in enumerate(members) if m not in fixed]
    least = len(mirror_pairs(shape))
    for order in itertools.permutations([members[r] for r in free]):
        trial = list(members)
        for r, m in zip(free, order, strict=True):
            trial[r] = m
        least = min(least, pairs_on_one_node(shape, trial, node_of))
    got = pairs_on_one_node(shape, out, node_of)
    assert got <= pairs_on_one_node(shape, members, node_of)
    if not fixed:  # every member free: the least there is
        assert got == least


def test_spread_alternates_nodes_on_the_ring_and_keeps_tp_groups_on_a_node() -> None:
    # Four members, two per node, listed node by node: a node's loss would take both holders
    # of two shards.
    members = ["a0", "a1", "b0", "b1"]
    node_of = {m: m[0] for m in members}
    ring = Degrees(dp=4, zero=1, mirror=True)
    assert pairs_on_one_node(ring, members, node_of) == 2
    out = spread(ring, members, (), node_of)
    assert [node_of[m] for m in out] in (list("abab"), list("baba"))
    # tp=2 groups of one node, their dp neighbours on the other.
    grid = Degrees(dp=2, tp=2, zero=3, mirror=True)
    out = spread(grid, ["a0", "b0", "a1", "b1"], (), node_of)
    assert [node_of[m] for m in out] in (list("aabb"), list("bbaa"))
    assert pairs_on_one_node(grid, out, node_of) == 0


def test_spread_places_joiners_around_the_members_that_stay() -> None:
    # Survivors a0 and b0 keep ranks 0 and 1; the joiners go where neither holder of a shard
    # shares a node: a1 at rank 2, b1 at rank 3.
    node_of = {"a0": "a", "b0": "b", "a1": "a", "b1": "b"}
    out = spread(Degrees(dp=4, zero=1, mirror=True), ["a0", "b0", "b1", "a1"], {"a0", "b0"},
                 node_of)  # fmt: skip
    assert out == ["a0", "b0", "a1", "b1"]


def test_members_of_no_known_node_and_layouts_without_a_mirror_are_left_in_order() -> None:
    members = ["x", "y", "z", "w"]
    assert spread(Degrees(dp=4, zero=1, mirror=True), members, (), {}) == members
    assert spread(Degrees(dp=4, zero=1), members, (), dict.fromkeys(members, "a")) == members


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_respread_exchanges_members_only_to_part_mirror_pairs(data: st.DataObject) -> None:
    shape, members, node_of = _members_on_nodes(data, "abc")
    out = respread(shape, members, node_of)
    assert sorted(out) == sorted(members)
    before, after = (pairs_on_one_node(shape, m, node_of) for m in (members, out))
    assert after <= before
    assert (out == members) == (after == before)  # a member moves only to part some pair
    assert respread(shape, members, {**node_of, members[0]: ""}) == members  # a node unknown


def test_respread_by_hand() -> None:
    # The ring a0-a1-b0-b1: two pairs on a node; one exchange parts both, two members keep
    # their rank (and their state).
    members = ["a0", "a1", "b0", "b1"]
    node_of = {m: m[0] for m in members}
    ring = Degrees(dp=4, zero=1, mirror=True)
    out = respread(ring, members, node_of)
    assert pairs_on_one_node(ring, out, node_of) == 0
    assert sum(a != b for a, b in zip(out, members, strict=True)) == 2
    assert respread(ring, out, node_of) == out


def test_balanced_takes_pods_from_the_least_crowded_node_first() -> None:
    node_of = {"a0": "a", "a1": "a", "a2": "a", "b0": "b", "b1": "b"}
    assert balanced(list(node_of), node_of) == ["a0", "b0", "a1", "b1", "a2"]
    # Two members already on b: a's pods first; a pod of no known node is a node of its own.
    placed = ["b0", "b2"]
    assert balanced(["b1", "a0", "x", "a1"], {**node_of, "b2": "b"}, placed) == ["a0", "x", "a1",
                                                                                 "b1"]  # fmt: skip
