"""Strategies and brute-force checkers shared by the layout, plan and schedule tests.

The checkers recompute everything from `region()` (one rank, one tensor at a time) and plain box
arithmetic, never from the planner's partitions, classes or matchings.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import combinations, pairwise

from hypothesis import strategies as st

from liveshard_core.layout.layout import Degrees, Layout
from liveshard_core.layout.region import region
from liveshard_core.plan.plan import Plan, source_layout
from liveshard_core.vps.box import Box, intersect, volume
from liveshard_core.vps.spec import DType, ModelSpec, TensorRef, TransformerConfig
from tests.helpers import names

MAX_WORLD = 8


def inside(piece: Box, box: Box) -> bool:
    return all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(piece, box, strict=True))


def pairwise_disjoint(boxes: list[Box]) -> bool:
    return all(intersect(a, b) is None for a, b in combinations(boxes, 2))


def itemsize(spec: ModelSpec, ref: TensorRef) -> int:
    return spec.dtype(ref.kind).itemsize


# --- strategies ---------------------------------------------------------------------------------


@st.composite
def configs(draw: st.DrawFn) -> TransformerConfig:
    """Small transformer configs: dense or MoE, fused or not, tied or not, odd sizes included."""
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    experts = draw(st.sampled_from([0, 0, 2, 4]))
    return TransformerConfig(
        name="rand",
        vocab=draw(st.sampled_from([4, 6, 8])),
        hidden=draw(st.integers(1, 5)),
        layers=draw(st.integers(1, 3)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.integers(1, 3)),
        ffn=draw(st.sampled_from([2, 4, 6])),
        experts=experts,
        expert_ffn=draw(st.sampled_from([2, 4])) if experts else 0,
        tied_embeddings=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        fused_qkv=draw(st.booleans()),
        fused_gate_up=draw(st.booleans()),
        param_dtype=draw(st.sampled_from(list(DType))),
    )


@st.composite
def compositions(draw: st.DrawFn, total: int, parts: int) -> tuple[int, ...]:
    """`total` split into `parts` positive integers, in any (possibly uneven) way."""
    if parts == 1:
        return (total,)
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=parts - 1,
                                max_size=parts - 1, unique=True)))  # fmt: skip
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in pairwise(bounds))


@st.composite
def degrees(draw: st.DrawFn, spec: ModelSpec, max_world: int = MAX_WORLD) -> Degrees:
    """Feasible degrees for `spec` with at most `max_world` ranks."""
    cfg = spec.config
    width = cfg.expert_ffn if cfg.experts else cfg.ffn
    tps = [t for t in (1, 2, 3, 4) if not (cfg.heads % t or cfg.kv_heads % t or cfg.vocab % t
                                           or width % t)]  # fmt: skip
    tp = draw(st.sampled_from(tps))
    pp = draw(st.integers(1, min(cfg.layers, max_world // tp, 3)))
    dp = draw(st.integers(1, max_world // (tp * pp)))
    eps = [
        e
        for e in range(1, dp + 1)
        if dp % e == 0 and (e == 1 or (cfg.experts and cfg.experts % e == 0))
    ]
    ep = draw(st.sampled_from(eps))
    zero = draw(st.sampled_from([0, 1, 3]))
    pp_layers = draw(st.one_of(st.none(), compositions(cfg.layers, pp)))
    mirror = Layout.can_mirror(dp, tp, pp, ep, zero) and draw(st.booleans())
    return Degrees(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, pp_layers=pp_layers, mirror=mirror)


@st.composite
def new_members(draw: st.DrawFn, old: list[str], size: int) -> list[str]:
    """A new member list of `size`: some old members (any subset, usually in old order, sometimes
    shuffled) and fresh ones (usually appended, sometimes interleaved)."""
    keep = draw(st.integers(0, min(len(old), size)))
    kept = sorted(draw(st.permutations(range(len(old))))[:keep])
    members = [old[i] for i in kept] + [f"n{i}" for i in range(size - keep)]
    if draw(st.integers(0, 3)) == 0:
        members = list(draw(st.permutations(members)))
    return members


@dataclass(frozen=True)
class Case:
    spec: ModelSpec
    old: Layout
    new: Layout


@st.composite
def cases(draw: st.DrawFn, max_world: int = MAX_WORLD) -> Case:
    """A random spec and a pair of feasible layouts with a random change of members."""
    spec = ModelSpec.from_config(draw(configs()))
    a = draw(degrees(spec, max_world))
    b = draw(degrees(spec, max_world))
    old_members = names(a.world_size)
    old = a.layout(spec, old_members)
    new = b.layout(spec, draw(new_members(old_members, b.world_size)))
    return Case(spec, old, new)


# --- brute force --------------------------------------------------------------------------------

Key = tuple[TensorRef, int, int, Box]


def expanded(plan: Plan) -> list[Key]:
    """Every piece of the plan as (tensor, src, dst, box)."""
    return [(ref, t.src, t.dst, t.box) for ref, _, t in plan.items()]


def brute_lower_bound(spec: ModelSpec, old: Layout, new: Layout) -> int:
    """Bytes of every new region that the same member did not hold in its old region."""
    old_rank = {m: r for r, m in enumerate(old.members)}
    total = 0
    for rank, member in enumerate(new.members):
        for ref in spec.tensors():
            need = region(spec, new, rank, ref)
            held = region(spec, old, old_rank[member], ref) if member in old_rank else []
            missing = sum(volume(b) for b in need)
            missing -= sum(volume(o) for b in need for h in held if (o := intersect(b, h)))
            total += missing * itemsize(spec, ref)
    return total


def new_region_bytes(spec: ModelSpec, layout: Layout) -> int:
    return sum(
        volume(b) * itemsize(spec, ref)
        for rank in range(layout.world_size)
        for ref in spec.tensors()
        for b in region(spec, layout, rank, ref)
    )


def check_plan(
    spec: ModelSpec, old: Layout, new: Layout, plan: Plan, lost: frozenset[str] = frozenset()
) -> None:
    """Exact cover, validity, minimality and the byte figures of `plan`, by brute force; `lost`
    members must take no part, and a byte is read only where `source_layout` trusts it."""
    source = source_layout(old, lost)
    union = tuple(m for m in old.members if m not in lost) + tuple(
        m for m in new.members if m not in old.members
    )
    assert plan.members == union
    old_rank = {m: r for r, m in enumerate(old.members)}
    received: dict[tuple[int, TensorRef], list[Box]] = defaultdict(list)
    network = local = 0
    sends: Counter[int] = Counter()
    recvs: Counter[int] = Counter()
    network_pieces = 0
    for ref, size, t in plan.items():
        assert size == itemsize(spec, ref)
        assert volume(t.box) > 0
        src = union[t.src]
        # (b) validity: the source held the piece under the old layout.
        assert src in old_rank, f"{src} sends but was not in the old layout"
        held = region(spec, source, old_rank[src], ref)
        assert any(inside(t.box, h) for h in held), (ref, t)
        received[(t.dst, ref)].append(t.box)
        n = volume(t.box) * size
        if t.src == t.dst:
            local += n
        else:
            network += n
            network_pieces += 1
            sends[t.src] += n
            recvs[t.dst] += n
            # Nothing crosses the network that the destination already held.
            receiver = union[t.dst]
            if receiver in old_rank:
                for h in region(spec, source, old_rank[receiver], ref):
                    assert intersect(t.box, h) is None, (ref, t)
    # (a) exact cover of every new region, and nothing for anyone else.
    for rank, member in enumerate(new.members):
        dst = union.index(member)
        for ref in spec.tensors():
            need = region(spec, new, rank, ref)
            pieces = received.pop((dst, ref), [])
            assert pairwise_disjoint(pieces), (member, ref, pieces)
            for piece in pieces:
                assert any(inside(piece, b) for b in need), (member, ref, piece, need)
            assert sum(map(volume, pieces)) == sum(map(volume, need)), (member, ref)
    assert not received, f"pieces for members that need nothing: {list(received)[:3]}"
    # (c) byte figures.
    assert plan.network_bytes == network
    assert plan.local_bytes == local
    assert plan.network_pieces == network_pieces
    assert local + network == new_region_bytes(spec, new)
    assert plan.slot_bytes == (dict(sends), dict(recvs))
