"""Regions: which boxes of each logical tensor each rank holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.layout.region import owner_of, partition, place, rank_boxes, region
from liveshard_core.vps.box import Box, full_box, volume
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, StateKind, TensorRef, TransformerConfig
from tests.core.helpers import cases, inside, pairwise_disjoint

TINY = preset("tiny")
MOE = preset("tiny-moe")


def ref(spec: ModelSpec, name: str, kind: StateKind) -> TensorRef:
    return TensorRef([p.name for p in spec.params].index(name), kind)


def rows(*intervals: tuple[int, int], cols: int = 64) -> list[Box]:
    return [((a, b), (0, cols)) for a, b in intervals]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_partition_covers_once_and_agrees_with_rank_boxes(data: st.DataObject) -> None:
    case = data.draw(cases())
    spec, layout = case.spec, case.old
    for param in spec.params:
        for kind in StateKind:
            placed = place(spec, layout, param, kind)
            parts = partition(layout, placed)
            boxes = [box for box, _ in parts]
            assert all(volume(b) > 0 for b in boxes)
            assert all(inside(b, full_box(param.shape)) for b in boxes)
            assert pairwise_disjoint(boxes)
            numel = volume(full_box(param.shape))
            assert sum(map(volume, boxes)) == numel
            for _, holders in parts:
                assert list(holders) == sorted(set(holders))
                assert holders, "a box nobody holds"
            for rank in range(layout.world_size):
                mine = sorted(b for b, holders in parts if rank in holders)
                assert sorted(rank_boxes(layout, placed, rank)) == mine
                r = TensorRef(spec.params.index(param), kind)
                assert sorted(region(spec, layout, rank, r)) == mine
            # Replication: the holders of each box, counted over the layout, hold the whole
            # tensor exactly (dp or dp/ep replicas if not sharded; one if sharded, two when
            # mirrored in a group of two or more) times per stage; a mirrored layout holds
            # every box twice at least.
            stages = len(placed.stages)
            group = layout.dp if param.expert is None else layout.dp // layout.ep
            shard_copies = 2 if layout.mirror and group > 1 else 1
            copies = stages * (shard_copies if placed.sharded else group)
            if param.split_dim is None:
                copies *= layout.tp
            if placed.peer:  # held once, and by its holder's peer (along pp: two stages)
                copies *= 2
            held = sum(volume(b) * len(h) for b, h in parts)
            assert held == copies * numel
            if layout.mirror:
                assert all(len(h) >= 2 for _, h in parts), "a mirrored box held once"


def test_a_mirrored_shard_is_held_by_its_member_and_the_next_of_its_group() -> None:
    """tiny-moe, dp=4, ep=2, ZeRO-1, mirrored: a dense weight's 4 shards go round the dp
    group, an expert's 2 shards round its expert-dp group (dp indices of one ep rank)."""
    spec = MOE
    layout = Layout.create(spec, [f"m{i}" for i in range(4)], dp=4, ep=2, zero=1, mirror=True)
    dense = spec.params[[p.name for p in spec.params].index("layers.0.attn.o")]
    parts = partition(layout, place(spec, layout, dense, StateKind.EXP_AVG))
    assert [holders for _, holders in parts] == [(0, 1), (1, 2), (2, 3), (0, 3)]
    # Parameters are not ZeRO-1's shards: replicated, as without the mirror.
    assert [h for _, h in partition(layout, place(spec, layout, dense, StateKind.PARAM))] == [
        (0, 1, 2, 3)
    ]
    expert = next(p for p in spec.params if p.expert == 1)  # ep rank 0 holds experts 0..half
    owner = owner_of(spec, layout, expert)
    parts = partition(layout, place(spec, layout, expert, StateKind.EXP_AVG))
    assert [holders for _, holders in parts] == [(owner, owner + 2)] * 2
    # Each rank holds its own shard and its predecessor's: twice ZeRO's share, no more.
    for rank in range(4):
        own = rank_boxes(layout, place(spec, layout, dense, StateKind.EXP_AVG), rank)
        assert len(own) == 2
    with pytest.raises(InvalidInput, match="mirror needs bytes held once"):
        Layout.create(spec, ["a", "b"], dp=2, zero=0, mirror=True)  # replicas hold everything
    assert parse_degrees("dp=4,zero=1,mirror=1").mirror
    assert parse_degrees(layout.describe()) == layout.degrees


def _holders(spec: ModelSpec, layout: Layout, name: str, kind: StateKind) -> list[tuple[int, ...]]:
    param = spec.params[[p.name for p in spec.params].index(name)]
    return [holders for _, holders in partition(layout, place(spec, layout, param, kind))]


def test_a_box_no_replica_holds_is_held_also_by_its_holders_next_peer() -> None:
    """A mirrored layout without replicas: the next member along dp (an expert of ep = dp), else
    along pp, else along tp (a split tensor) holds each box too, round."""
    members = [f"m{i}" for i in range(4)]
    tp2 = Layout.create(TINY, members, tp=2, pp=2, mirror=True)
    # Along pp, where tp groups never are (a pod's loss leaves the copy): split along dim 1 on
    # stage 0 (ranks 0, 1), tp index t's box is held by t and by t on stage 1 (ranks 2, 3).
    assert _holders(TINY, tp2, "layers.0.attn.o", StateKind.PARAM) == [(0, 2), (1, 3)]
    assert _holders(TINY, tp2, "layers.3.attn.o", StateKind.EXP_AVG) == [(0, 2), (1, 3)]
    # Not split: the stage's tp ranks hold it alike, and the next stage's too.
    assert _holders(TINY, tp2, "layers.0.attn.norm", StateKind.EXP_AVG) == [(0, 1, 2, 3)]
    tp_only = Layout.create(TINY, members[:2], tp=2, mirror=True)  # no dp, no pp: along tp
    assert _holders(TINY, tp_only, "layers.0.attn.o", StateKind.PARAM) == [(0, 1), (0, 1)]
    assert _holders(TINY, tp_only, "layers.0.attn.norm", StateKind.EXP_AVG) == [(0, 1)]
    pp4 = Layout.create(TINY, members, pp=4, mirror=True)  # one layer a stage
    assert _holders(TINY, pp4, "layers.3.mlp.down", StateKind.EXP_AVG) == [(0, 3)]
    assert _holders(TINY, pp4, "layers.1.mlp.down", StateKind.MASTER) == [(1, 2)]
    experts = Layout.create(MOE, members, dp=4, ep=4, zero=1, mirror=True)  # 2 experts a rank
    expert = next(p for p in MOE.params if p.expert == 7)
    assert _holders(MOE, experts, expert.name, StateKind.EXP_AVG) == [(0, 3)]
    # With tp too, along dp still: expert 3 (ep rank 0) on dp 0 (ranks 0, 1) and dp 1.
    tp_experts = Layout.create(MOE, members, dp=2, ep=2, tp=2, mirror=True)
    expert = next(p for p in MOE.params if p.expert == 3 and p.split_dim is not None)
    assert _holders(MOE, tp_experts, expert.name, StateKind.EXP_AVG) == [(0, 2), (1, 3)]
    # Dense weights: ZeRO-1 shards mirrored round the dp group, as without experts.
    ring = [(0, 1), (1, 2), (2, 3), (0, 3)]
    assert _holders(MOE, experts, "layers.0.attn.o", StateKind.EXP_AVG) == ring
    # Without the copy: what each member computes with.
    param = TINY.params[[p.name for p in TINY.params].index("layers.0.attn.o")]
    alone = place(TINY, tp2, param, StateKind.PARAM, peer=False)
    assert [h for _, h in partition(tp2, alone)] == [(0,), (1,)]
    assert parse_degrees(tp2.describe()) == tp2.degrees
    # Packed onto one member, a pipeline without replicas has no one to mirror it.
    assert not parse_degrees("pp=2,mirror=1").repartitioned((4,)).mirror
    assert parse_degrees("pp=2,mirror=1").repartitioned((1, 1, 2)).mirror


def test_fused_qkv_zero1_by_hand() -> None:
    """tiny `layers.0.attn.qkv`: shape [128, 64], parts q=64, kv=32, kv=32 along dim 0."""
    layout = Layout.create(TINY, [f"m{i}" for i in range(6)], dp=3, tp=2, zero=1)
    qkv = "layers.0.attn.qkv"
    param, master = ref(TINY, qkv, StateKind.PARAM), ref(TINY, qkv, StateKind.MASTER)
    # rank = dp_i * tp + tp_i. tp rank 0 holds the first half of each part:
    # q [0,32), k [64,80), v [96,112): 32 + 16 + 16 = 64 local rows.
    tp0 = rows((0, 32), (64, 80), (96, 112))
    tp1 = rows((32, 64), (80, 96), (112, 128))
    for dp_i in range(3):
        assert region(TINY, layout, dp_i * 2, param) == tp0  # ZeRO-1 keeps the param whole
        assert region(TINY, layout, dp_i * 2 + 1, param) == tp1
    # ZeRO-1 shards the 64 local rows in 3: ceil(64/3) = 22 -> local [0,22), [22,44), [44,64).
    # dp 0 (rank 0): local [0,22) = q rows [0,22).
    assert region(TINY, layout, 0, master) == rows((0, 22))
    # dp 1 (rank 2): local [22,32) is q rows [22,32); local [32,44) is k rows 64+0..64+12.
    assert region(TINY, layout, 2, master) == rows((22, 32), (64, 76))
    # dp 2 (rank 4): local [44,48) is k rows [76,80); local [48,64) is v rows [96,112).
    assert region(TINY, layout, 4, master) == rows((76, 80), (96, 112))
    # tp rank 1, dp 1 (rank 3): local [22,32) = q [54,64), local [32,44) = k [80,92).
    assert region(TINY, layout, 3, master) == rows((54, 64), (80, 92))
    # tp rank 1, dp 2 (rank 5): k [92,96) and v [112,128).
    assert region(TINY, layout, 5, master) == rows((92, 96), (112, 128))
    exp_avg = ref(TINY, qkv, StateKind.EXP_AVG)
    assert region(TINY, layout, 5, exp_avg) == rows((92, 96), (112, 128))


def test_split_dim1_and_replicated_zero3_by_hand() -> None:
    layout = Layout.create(TINY, [f"m{i}" for i in range(8)], dp=4, tp=2, zero=3)
    # down [64, 192], tp splits dim 1: tp rank 1 has columns [96,192); ZeRO-3 shards all 64 rows
    # in 4: 16 rows each. Rank 7 = dp 3, tp 1: rows [48,64), columns [96,192).
    down = ref(TINY, "layers.1.mlp.down", StateKind.PARAM)
    assert region(TINY, layout, 7, down) == [((48, 64), (96, 192))]
    # attn.norm [64] is replicated by tp: both tp ranks of dp 2 hold rows [32,48).
    norm = ref(TINY, "layers.1.attn.norm", StateKind.EXP_AVG_SQ)
    assert region(TINY, layout, 4, norm) == [((32, 48),)]
    assert region(TINY, layout, 5, norm) == [((32, 48),)]


def test_uneven_zero_with_empty_trailing_shards() -> None:
    # A norm of 3 elements sharded over dp=4: ceil(3/4) = 1 -> [0,1), [1,2), [2,3), [3,3).
    cfg = TransformerConfig("n3", vocab=4, hidden=3, layers=1, heads=1, kv_heads=1, head_dim=2,
                            ffn=2)  # fmt: skip
    spec = ModelSpec.from_config(cfg)
    layout = Layout.create(spec, ["a", "b", "c", "d"], dp=4, zero=1)
    norm = ref(spec, "final_norm", StateKind.MASTER)
    assert [region(spec, layout, r, norm) for r in range(4)] == [
        [((0, 1),)],
        [((1, 2),)],
        [((2, 3),)],
        [],
    ]
    placed = place(spec, layout, spec.params[norm.param], StateKind.MASTER)
    assert partition(layout, placed) == [(((0, 1),), (0,)), (((1, 2),), (1,)), (((2, 3),), (2,))]


def test_experts_ep_and_expert_dp_group() -> None:
    # tiny-moe: 8 experts; dp=4, ep=2: expert e on ep rank e // 4; rank's ep rank = dp_i % 2.
    layout = Layout.create(MOE, [f"m{i}" for i in range(4)], dp=4, ep=2, zero=1)
    gate5 = "layers.0.mlp.experts.5.gate"  # [48, 64], owner ep rank 5 // 4 = 1
    gate2 = "layers.0.mlp.experts.2.gate"  # owner ep rank 0
    p5, m5 = ref(MOE, gate5, StateKind.PARAM), ref(MOE, gate5, StateKind.MASTER)
    # dp 1 and dp 3 have ep rank 1; they hold the param whole and split the master 2 ways
    # (expert-dp group [1, 3], size 4 / 2 = 2): rows [0,24) at dp 1, [24,48) at dp 3.
    assert region(MOE, layout, 0, p5) == []
    assert region(MOE, layout, 2, p5) == []
    assert region(MOE, layout, 1, p5) == [((0, 48), (0, 64))]
    assert region(MOE, layout, 1, m5) == [((0, 24), (0, 64))]
    assert region(MOE, layout, 3, m5) == [((24, 48), (0, 64))]
    assert region(MOE, layout, 2, ref(MOE, gate2, StateKind.MASTER)) == [((24, 48), (0, 64))]
    # The router is not an expert: every rank holds it, ZeRO shards it 4 ways (8 rows: 2 each).
    router = ref(MOE, "layers.0.mlp.router", StateKind.MASTER)
    assert region(MOE, layout, 3, router) == [((6, 8), (0, 64))]


def test_pipeline_stages_and_tied_embedding() -> None:
    layout = Layout.create(TINY, ["a", "b", "c"], pp=3, pp_layers=(1, 2, 1))
    embed = ref(TINY, "embed", StateKind.PARAM)
    final = ref(TINY, "final_norm", StateKind.PARAM)
    full_embed = [((0, 256), (0, 64))]
    # Tied embedding: stage 0 and the last stage.
    assert [region(TINY, layout, r, embed) for r in range(3)] == [full_embed, [], full_embed]
    assert [bool(region(TINY, layout, r, final)) for r in range(3)] == [False, False, True]
    # Layers 1 and 2 on stage 1 (rank 1), layer 3 on stage 2.
    for layer, stage in [(0, 0), (1, 1), (2, 1), (3, 2)]:
        r = ref(TINY, f"layers.{layer}.attn.o", StateKind.MASTER)
        assert [bool(region(TINY, layout, k, r)) for k in range(3)] == [
            k == stage for k in range(3)
        ]
    # Untied (tiny-moe): embed only on stage 0, lm_head only on the last.
    moe = Layout.create(MOE, ["a", "b"], pp=2)
    assert region(MOE, moe, 1, ref(MOE, "embed", StateKind.PARAM)) == []
    assert region(MOE, moe, 0, ref(MOE, "lm_head", StateKind.PARAM)) == []
    assert region(MOE, moe, 1, ref(MOE, "lm_head", StateKind.PARAM)) == full_embed
