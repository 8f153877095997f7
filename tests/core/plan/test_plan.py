"""Piece plans: exact cover, validity, minimality, determinism, per-member views."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.layout.layout import Layout
from liveshard_core.plan.bounds import lower_bound_bytes
from liveshard_core.plan.matching import Piece
from liveshard_core.plan.plan import build_plan
from liveshard_core.plan.union import union_members
from liveshard_core.plan.view import plan_view
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, StateKind, TensorRef
from tests.core.helpers import Case, Key, brute_lower_bound, cases, check_plan, expanded
from tests.helpers import names

TINY = preset("tiny")
MOE = preset("tiny-moe")


def check_views(spec: ModelSpec, old: Layout, new: Layout) -> None:
    """(e) every member's view equals the expanded plan filtered to that member."""
    plan = build_plan(spec, old, new)
    pieces = expanded(plan)
    for index, member in enumerate(plan.members):
        view = plan_view(spec, old, new, member)
        assert view.part.member == member
        assert view.part.slot == index

        local = Counter(p for p in pieces if p[1] == p[2] == index)
        sends = Counter(p for p in pieces if p[1] == index != p[2])
        recvs = Counter(p for p in pieces if p[2] == index != p[1])
        assert keys(view.local) == local, member
        assert keys(view.sends) == sends, member
        assert keys(view.recvs) == recvs, member


def keys(items: tuple[tuple[TensorRef, Piece], ...]) -> Counter[Key]:
    return Counter((ref, t.src, t.dst, t.box) for ref, t in items)


def check_all(spec: ModelSpec, old: Layout, new: Layout) -> None:
    plan = build_plan(spec, old, new)
    check_plan(spec, old, new, plan)
    lower = brute_lower_bound(spec, old, new)
    assert plan.network_bytes == lower
    assert lower_bound_bytes(spec, old, new) == lower
    again = build_plan(spec, old, new)
    assert again.digest == plan.digest
    assert expanded(again) == expanded(plan)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_plan_invariants(case: Case) -> None:
    check_all(case.spec, case.old, case.new)


@settings(max_examples=30, deadline=None)
@given(cases(max_world=6))
def test_plan_view_equals_filtered_plan(case: Case) -> None:
    check_views(case.spec, case.old, case.new)


# --- named member changes on the presets ----------------------------------------------------

Scenario = tuple[ModelSpec, dict[str, Any], list[str], dict[str, Any], list[str]]
SCENARIOS: dict[str, Scenario] = {
    # name: (spec, old degrees, old members, new degrees, new members)
    "grow": (TINY, {"dp": 2, "zero": 1}, names(2), {"dp": 4, "zero": 1},
             [*names(2), *names(2, "n")]),
    "shrink": (TINY, {"dp": 4, "zero": 3}, names(4), {"dp": 2, "zero": 3}, names(2)),
    "drop-specific": (TINY, {"dp": 4, "zero": 1}, names(4), {"dp": 2, "zero": 1},
                      ["m1", "m3"]),
    "replace": (MOE, {"dp": 2, "tp": 2, "ep": 2, "zero": 1}, names(4),
                {"dp": 2, "tp": 2, "ep": 2, "zero": 1}, ["m0", "n0", "m2", "m3"]),
    "1-to-N": (MOE, {}, ["m0"], {"dp": 2, "pp": 2, "ep": 2, "zero": 3}, ["m0", *names(3, "n")]),
    "N-to-1": (MOE, {"dp": 2, "tp": 2, "pp": 2, "zero": 3, "ep": 2}, names(8), {}, ["m5"]),
    "all-new": (TINY, {"tp": 2, "pp": 2}, names(4), {"dp": 2, "tp": 2}, names(4, "n")),
    "reorder": (TINY, {"dp": 2, "tp": 2, "zero": 1}, names(4),
                {"dp": 2, "tp": 2, "zero": 1}, ["m3", "m2", "m1", "m0"]),
    "uneven-pp": (MOE, {"pp": 2, "pp_layers": (1, 3)}, names(2),
                  {"pp": 3, "pp_layers": (2, 1, 1), "zero": 1}, ["m1", "m0", "n0"]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_member_change_scenarios(name: str) -> None:
    spec, a, old_members, b, new_members = SCENARIOS[name]
    old = Layout.create(spec, old_members, **a)
    new = Layout.create(spec, new_members, **b)
    check_all(spec, old, new)


@pytest.mark.parametrize("name", ["replace", "N-to-1", "drop-specific"])
def test_member_change_views(name: str) -> None:
    spec, a, old_members, b, new_members = SCENARIOS[name]
    old = Layout.create(spec, old_members, **a)
    new = Layout.create(spec, new_members, **b)
    check_views(spec, old, new)


def test_union_members() -> None:
    old = Layout.create(TINY, ["a", "b", "c"], dp=3)
    new = Layout.create(TINY, ["x", "c", "a", "y"], dp=4)
    # Old members in old rank order, then new-only members in new rank order.
    assert union_members(old, new) == ("a", "b", "c", "x", "y")
    assert build_plan(TINY, old, new).members == ("a", "b", "c", "x", "y")


def test_plan_view_unknown_member() -> None:
    old = Layout.create(TINY, ["a"])
    with pytest.raises(ValueError, match="'zz'"):
        plan_view(TINY, old, old, "zz")


def test_identity_plan_is_all_local() -> None:
    old = Layout.create(MOE, names(8), dp=2, tp=2, pp=2, ep=2, zero=1)
    plan = build_plan(MOE, old, old)
    assert plan.network_bytes == 0
    assert plan.network_pieces == 0
    assert all(t.src == t.dst for _, _, t in plan.items())
    check_plan(MOE, old, old, plan)


def test_infeasible_layout_rejected() -> None:
    old = Layout.create(MOE, names(2), dp=2, ep=2)
    with pytest.raises(ValueError, match="ep=2"):
        build_plan(TINY, old, old)


# --- (d) digests ------------------------------------------------------------------------------

DIGEST_SCRIPT = """
import hashlib
import sys
from liveshard_core.layout.layout import Layout
from liveshard_core.plan.matching import Piece
from liveshard_core.plan.plan import build_plan
from liveshard_core.vps.presets import preset
spec = preset("tiny-moe")
old = Layout.create(spec, [f"m{i}" for i in range(8)], dp=4, pp=2, ep=2, zero=1,
                    pp_layers=(1, 3))
new = Layout.create(spec, ["m6", "m1", "n0", "m3", "n1", "m0"], dp=3, tp=2, zero=3)
plan = build_plan(spec, old, new)
print(plan.digest, hashlib.sha256(repr(plan.items()).encode()).hexdigest())
"""


def digest_case() -> tuple[Layout, Layout]:
    old = Layout.create(MOE, names(8), dp=4, pp=2, ep=2, zero=1, pp_layers=(1, 3))
    new = Layout.create(MOE, ["m6", "m1", "n0", "m3", "n1", "m0"], dp=3, tp=2, zero=3)
    return old, new


def test_plan_and_digest_are_the_same_in_other_processes() -> None:
    old, new = digest_case()
    plan = build_plan(MOE, old, new)
    assert len(plan.digest) == 64
    assert int(plan.digest, 16) >= 0  # hex
    here = f"{plan.digest} {hashlib.sha256(repr(plan.items()).encode()).hexdigest()}"
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", DIGEST_SCRIPT], env=env, capture_output=True, text=True,
            check=True, timeout=60,
        )  # fmt: skip
        assert out.stdout.strip() == here, f"PYTHONHASHSEED={seed}"


def test_digests_differ_when_layouts_differ() -> None:
    old, new = digest_case()
    base = build_plan(MOE, old, new).digest
    variants = [
        Layout.create(MOE, new.members, dp=3, tp=2, zero=1),  # ZeRO stage
        Layout.create(MOE, new.members, dp=6, zero=3),  # degrees
        Layout.create(MOE, ["m1", "m6", "n0", "m3", "n1", "m0"], dp=3, tp=2, zero=3),  # order
        Layout.create(MOE, ["m6", "m1", "n9", "m3", "n1", "m0"], dp=3, tp=2, zero=3),  # names
    ]
    digests = {base} | {build_plan(MOE, old, v).digest for v in variants}
    assert len(digests) == 1 + len(variants)
    assert build_plan(MOE, new, old).digest != base  # direction matters
    other = Layout.create(MOE, names(8), dp=4, pp=2, ep=2, zero=1, pp_layers=(2, 2))
    assert build_plan(MOE, other, new).digest != base


# --- (f) load spreading -----------------------------------------------------------------------


def test_replicas_share_the_sending() -> None:
    """dp=4 -> dp=8 on tiny, zero=0: 4 new members each need a full copy held by 4 replicas.

    Round-robin: the holder i of new box k (i = 4..7 for the new members) gets old box j from
    holders[(ord(j) + ord(k) + i) % 4], so every box is sent once by each of the 4 old members.
    """
    old = Layout.create(TINY, names(4), dp=4)
    new = Layout.create(TINY, [*names(4), *names(4, "n")], dp=8)
    plan = build_plan(TINY, old, new)
    embed = [t for ref, _, t in plan.items() if ref.param == 0 and ref.kind is StateKind.PARAM]
    network = sorted((t.dst, t.src) for t in embed if t.src != t.dst)
    # embed is one box (j = 0) with holders (0, 1, 2, 3): dst 4 <- 0, 5 <- 1, 6 <- 2, 7 <- 3.
    assert network == [(4, 0), (5, 1), (6, 2), (7, 3)]
    # qkv has three boxes (parts q, k, v; ordinals 0, 1, 2 in both layouts): dst 4 (i = 4) gets
    # them from holders (0 + 4) % 4, (2 + 4) % 4, (4 + 4) % 4.
    qkv = TINY.params.index(next(p for p in TINY.params if p.name == "layers.0.attn.qkv"))
    got = sorted((t.box[0], t.src) for ref, _, t in plan.items()
                 if ref.param == qkv and ref.kind is StateKind.MASTER and t.dst == 4)  # fmt: skip
    assert got == [((0, 64), 0), ((64, 96), 2), ((96, 128), 0)]
    # Every old member sends one full copy of the state: tiny has 213568 elements of 2 + 3*4 bytes.
    sends, recvs = plan.slot_bytes
    assert sends == {m: 213568 * 14 for m in range(4)}
    assert recvs == {m: 213568 * 14 for m in range(4, 8)}
    assert plan.network_bytes == 4 * 213568 * 14
    assert plan.local_bytes == 4 * 213568 * 14


# --- worked examples, bytes by hand ------------------------------------------------------------
# tiny: embed 256*64 = 16384; per layer attn.norm 64, qkv 128*64 = 8192, o 64*64 = 4096,
# mlp.norm 64, gate_up 384*64 = 24576, down 64*192 = 12288 (sum 49280); final_norm 64.
# Total 16384 + 4*49280 + 64 = 213568 elements; 14 bytes each (bf16 param, 3 fp32 states).
TINY_ELEMS = 16384 + 4 * 49280 + 64


def test_n_to_1_zero0_keeps_everything_local() -> None:
    # dp=2 -> dp=1, zero=0: m0 already holds a full replica.
    old = Layout.create(TINY, ["m0", "m1"], dp=2)
    plan = build_plan(TINY, old, Layout.create(TINY, ["m0"]))
    assert plan.network_bytes == 0
    assert plan.local_bytes == TINY_ELEMS * 14 == 2989952
    # ... but a new member replacing both needs everything over the network.
    fresh = build_plan(TINY, old, Layout.create(TINY, ["n0"]))
    assert fresh.network_bytes == 2989952
    assert fresh.local_bytes == 0


def test_n_to_1_zero1_fetches_the_other_half_of_the_fp32_state() -> None:
    # dp=2 -> dp=1 under zero=1: m0 holds the full bf16 params and ZeRO shard 0 of each fp32
    # tensor. Every dim-0 length of tiny is even (256, 64, 128, 384), so shard 1 is half of
    # every tensor: m1 sends TINY_ELEMS / 2 elements of each of the 3 fp32 kinds.
    old = Layout.create(TINY, ["m0", "m1"], dp=2, zero=1)
    plan = build_plan(TINY, old, Layout.create(TINY, ["m0"], zero=1))
    assert plan.network_bytes == TINY_ELEMS // 2 * 3 * 4 == 1281408
    assert plan.local_bytes == TINY_ELEMS * 2 + TINY_ELEMS // 2 * 12
    assert plan.slot_bytes == ({1: 1281408}, {0: 1281408})


def test_tp1_to_tp2_adds_one_member() -> None:
    # m0 keeps tp rank 0; new member n0 needs tp rank 1: half of every tp-split tensor
    # (embed, qkv, o, gate_up, down) and the whole of every norm (replicated by tp).
    # split: 16384 / 2 + 4 * (8192 + 4096 + 24576 + 12288) / 2 = 8192 + 98304 = 106496
    # norms: 4 * (64 + 64) + 64 = 576;  total 107072 elements, 14 bytes each.
    old = Layout.create(TINY, ["m0"])
    plan = build_plan(TINY, old, Layout.create(TINY, ["m0", "n0"], tp=2))
    assert plan.network_bytes == 107072 * 14 == 1499008
    # m0 keeps the same share: tp rank 0 is also half of each split tensor plus all norms.
    assert plan.local_bytes == 1499008
    assert plan.slot_bytes == ({0: 1499008}, {1: 1499008})


def test_moe_ep2_to_ep1() -> None:
    # tiny-moe dp=2: ep=2 -> ep=1, zero=0. m0 (ep rank 0) holds experts 0..3, m1 experts 4..7;
    # under ep=1 both need all 8. Each receives 4 experts x 4 layers of
    # gate 48*64 + up 48*64 + down 64*48 = 9216 elements: 2 * 4 * 4 * 9216 = 294912 elements.
    old = Layout.create(MOE, ["m0", "m1"], dp=2, ep=2)
    plan = build_plan(MOE, old, Layout.create(MOE, ["m0", "m1"], dp=2))
    assert plan.network_bytes == 294912 * 14 == 4128768
    assert plan.slot_bytes == ({0: 4128768 // 2, 1: 4128768 // 2},) * 2


def test_pp2_to_dp2() -> None:
    # pp=2 -> dp=2 with the same two members. Stage 0 (m0) has embed and layers 0, 1; stage 1
    # (m1) has layers 2, 3, final_norm and the tied embed. Under dp=2 both need everything:
    # m0 gets 2 layers + final_norm = 2*49280 + 64, m1 gets 2 layers = 2*49280.
    old = Layout.create(TINY, ["m0", "m1"], pp=2)
    plan = build_plan(TINY, old, Layout.create(TINY, ["m0", "m1"], dp=2))
    m0, m1 = (2 * 49280 + 64) * 14, 2 * 49280 * 14
    assert plan.slot_bytes == ({1: m0, 0: m1}, {0: m0, 1: m1})
    assert plan.network_bytes == m0 + m1 == 2760576  # 1380736 + 1379840


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_lower_bound_matches_brute_force(data: st.DataObject) -> None:
    case = data.draw(cases())
    assert lower_bound_bytes(case.spec, case.old, case.new) == brute_lower_bound(
        case.spec, case.old, case.new
    )


# --- lost members: recovery from surviving copies -------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(cases(), st.data())
def test_lost_members_plans_use_surviving_copies_or_fail_clearly(case: Case, data: Any) -> None:
    candidates = [m for m in case.old.members if m not in case.new.members]
    lost = (
        frozenset(data.draw(st.lists(st.sampled_from(candidates), unique=True)))
        if candidates
        else frozenset()
    )
    try:
        plan = build_plan(case.spec, case.old, case.new, lost)
    except ValueError as err:
        assert lost and "no surviving copy" in str(err)
        return
    check_plan(case.spec, case.old, case.new, plan, lost)
    assert not lost & set(plan.members)


def test_lost_member_with_replicas_is_recovered() -> None:
    old = Layout.create(TINY, names(4), dp=4)  # zero=0: every member holds everything
    new = Layout.create(TINY, ["m0", "m1", "m3"], dp=3)
    lost = frozenset({"m2"})
    plan = build_plan(TINY, old, new, lost)
    check_plan(TINY, old, new, plan, lost)
    assert plan.members == ("m0", "m1", "m3")
    assert plan.network_bytes == 0  # the survivors already hold all they need
    assert plan.digest != build_plan(TINY, old, new).digest


def test_lost_shard_without_copy_names_the_tensor() -> None:
    old = Layout.create(TINY, names(4), dp=4, zero=1)  # fp32 state sharded, no copies
    new = Layout.create(TINY, ["m0", "m1", "m3"], dp=3, zero=1)
    with pytest.raises(ValueError, match=r"no surviving copy of embed:master .*\['m2'\]"):
        build_plan(TINY, old, new, frozenset({"m2"}))


def param_pieces(plan: Any) -> list[tuple[str, str, Any]]:
    """(source, destination, box) of every network piece of the first parameter."""
    ref = TensorRef(0, StateKind.PARAM)
    return [(plan.members[p.src], plan.members[p.dst], p.box) for r, _, p in plan.items()
            if r == ref and p.src != p.dst]  # fmt: skip


def test_a_recovery_from_zero1_reads_parameters_from_their_shards_holders_only() -> None:
    # dp=4 mirrored: shard z of embed is held by members z and z+1. m1 died, perhaps inside the
    # parameter sharing after an update: a survivor's rows of others' shards may be a step old.
    old = Layout.create(TINY, names(4), dp=4, zero=1, mirror=True)
    new = Layout.create(TINY, ["m0", "m4", "m2", "m3"], dp=4, zero=1, mirror=True)
    lost = frozenset({"m1"})
    plan = build_plan(TINY, old, new, lost)
    check_plan(TINY, old, new, plan, lost)
    vocab = TINY.params[0].shape[0]
    rows = vocab // 4
    shard = {m: range(rows * z, rows * (z + 1)) for z, m in enumerate(names(4))}
    received: dict[str, int] = Counter()
    for src, dst, box in param_pieces(plan):
        # The source holds these rows' optimizer shard: its own or its predecessor's.
        mine = {src, names(4)[names(4).index(src) - 1]}
        assert any(box[0][0] in shard[m] and box[0][1] - 1 in shard[m] for m in mine), (src, box)
        received[dst] += box[0][1] - box[0][0]
    # Every member but the shards' holders receives them: m0 holds shards 0 and 3, so it takes
    # shards 1 and 2 again; the newcomer takes all four.
    assert received == {"m0": 2 * rows, "m4": vocab, "m2": 2 * rows, "m3": 2 * rows}
    # A change whose members keep their state reads the parameters from every replica.
    plan = build_plan(TINY, old, Layout.create(TINY, names(5), dp=5, zero=1, mirror=True))
    assert {d for _, d, _ in param_pieces(plan)} == {"m4"}


def test_lost_members_must_be_old_and_not_new() -> None:
    old = Layout.create(TINY, names(2), dp=2)
    with pytest.raises(ValueError, match=r"lost members \['x'\] are not members of the old"):
        build_plan(TINY, old, old, frozenset({"x"}))
    with pytest.raises(ValueError, match=r"lost members \['m1'\] cannot be members of the new"):
        build_plan(TINY, old, old, frozenset({"m1"}))
