"""Single-process tests of sharded state: seeded content, look-up, views, building and release."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="sharded state needs torch (the agent extra)")

from liveshard_agent.engine.state import (  # noqa: E402
    ShardedState,
    held_bytes_of,
    region_boxes,
    seeded_box,
    state_bytes_of,
)
from liveshard_core.layout.layout import Layout  # noqa: E402
from liveshard_core.vps.box import full_box  # noqa: E402
from liveshard_core.vps.presets import preset  # noqa: E402
from liveshard_core.vps.spec import DType, ModelSpec, StateKind, TensorRef  # noqa: E402
from tests.helpers import names  # noqa: E402

CPU = torch.device("cpu")
TINY = preset("tiny")
QKV = TINY.ref("layers.0.attn.qkv").param  # [128, 64]


def test_seeded_box_depends_only_on_the_global_index() -> None:
    ref = TensorRef(QKV, StateKind.MASTER)
    shape = TINY.params[QKV].shape
    whole = seeded_box(TINY, ref, full_box(shape), 7, CPU)
    part = seeded_box(TINY, ref, ((10, 20), (5, 64)), 7, CPU)
    assert torch.equal(whole[10:20, 5:64], part)
    assert not torch.equal(whole, seeded_box(TINY, ref, full_box(shape), 8, CPU))  # seed matters
    other = seeded_box(TINY, TensorRef(QKV, StateKind.EXP_AVG), full_box(shape), 7, CPU)
    assert not torch.equal(whole, other)  # so does the tensor
    assert whole.dtype == torch.float32
    assert seeded_box(TINY, TensorRef(QKV, StateKind.PARAM), full_box(shape), 7, CPU).dtype == (
        torch.bfloat16
    )


def test_state_holds_the_region_and_reports_bytes() -> None:
    layout = Layout.create(TINY, names(4), dp=2, tp=2, zero=1)
    for rank in range(4):
        state = ShardedState.seeded(TINY, layout, rank, 5, CPU)
        assert state.matches_seed(5) == []
        assert state.matches_seed(6) != []
        assert state.nbytes == state_bytes_of(TINY, layout, rank)
    assert state_bytes_of(TINY, Layout.create(TINY, ["solo"]), 0) == TINY.state_bytes


@pytest.mark.parametrize("zero", [1, 3])
def test_a_mirrored_member_of_two_holds_both_shards(zero: int) -> None:
    # dp=2 mirrored: each member holds its shard and the other's, the whole state of ZeRO-0.
    plain = Layout.create(TINY, names(2), dp=2, zero=zero)
    mirrored = Layout.create(TINY, names(2), dp=2, zero=zero, mirror=True)
    whole = Layout.create(TINY, names(2), dp=2)
    for rank in range(2):
        assert held_bytes_of(TINY, plain, rank) == (state_bytes_of(TINY, plain, rank), 0)
        added = state_bytes_of(TINY, whole, rank) - state_bytes_of(TINY, plain, rank)
        assert held_bytes_of(TINY, mirrored, rank) == (state_bytes_of(TINY, whole, rank), added)
        assert added > 0
        assert ShardedState.seeded(TINY, mirrored, rank, 5, CPU).nbytes == state_bytes_of(
            TINY, whole, rank
        )


def test_a_pipeline_of_two_without_replicas_mirrored_holds_the_whole_state_each() -> None:
    # pp=2, dp=1: each stage's boxes are held also by the other stage's member (its peer).
    mirrored = Layout.create(TINY, names(2), pp=2, mirror=True)
    plain = Layout.create(TINY, names(2), pp=2)
    for rank in range(2):
        own = state_bytes_of(TINY, plain, rank)
        assert held_bytes_of(TINY, mirrored, rank) == (TINY.state_bytes, TINY.state_bytes - own)


def test_fp32_model_has_no_master_copy() -> None:
    spec = ModelSpec.from_config(dataclasses.replace(TINY.config, param_dtype=DType.FP32))
    state = ShardedState.seeded(spec, Layout.create(spec, ["solo"]), 0, 5, CPU)
    assert {ref.kind for ref in state.boxes} == {
        StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ
    }  # fmt: skip
    assert state.nbytes == spec.state_bytes == TINY.state_bytes // 14 * 12
    with pytest.raises(ValueError, match="keeps no master state"):
        state.get("embed", StateKind.MASTER)


def test_lookup_by_name_and_kind() -> None:
    layout = Layout.create(TINY, names(2), tp=2, dp=1)
    state = ShardedState.seeded(TINY, layout, 1, 5, CPU)
    qkv = state.get("layers.0.attn.qkv", StateKind.EXP_AVG)
    # tp rank 1 holds the second half of each of the q, k and v parts: three boxes.
    assert [box for box, _ in qkv] == [((32, 64), (0, 64)), ((80, 96), (0, 64)),
                                       ((112, 128), (0, 64))]  # fmt: skip
    assert state.get("lm_head") == state.get("embed")  # the tied alias
    assert state.get("layers.0.attn.norm")[0][0] == ((0, 64),)
    with pytest.raises(ValueError, match=r"no parameter 'layers\.9\.attn\.q'"):
        state.get("layers.9.attn.q")


def test_view_finds_the_piece_or_names_what_is_missing() -> None:
    layout = Layout.create(TINY, names(2), tp=2)
    state = ShardedState.seeded(TINY, layout, 1, 5, CPU)
    ref = TensorRef(0, StateKind.MASTER)  # embed [256, 64], tp splits dim 0: rank 1 has 128..256
    piece = ((130, 140), (0, 64))
    assert torch.equal(state.view(ref, piece), seeded_box(TINY, ref, piece, 5, CPU))
    with pytest.raises(KeyError, match="rank 1 holds no box of embed:master"):
        state.view(ref, ((0, 10), (0, 64)))


def test_from_tensors_shares_the_callers_storage_and_checks_it() -> None:
    layout = Layout.create(TINY, names(2), dp=2, zero=1)
    seeded = ShardedState.seeded(TINY, layout, 0, 5, CPU)
    tensors = {ref: [t for _, t in boxes] for ref, boxes in seeded.boxes.items()}
    state = ShardedState.from_tensors(TINY, layout, 0, tensors)
    assert state.matches_seed(5) == []
    ref = TINY.ref("final_norm")
    state.boxes_of(ref)[0][1].fill_(0)
    assert seeded.boxes_of(ref)[0][1].eq(0).all()  # no copy was made
    missing = dict(tensors)
    del missing[ref]
    with pytest.raises(ValueError, match=r"none given for \['final_norm'\]"):
        ShardedState.from_tensors(TINY, layout, 0, missing)
    wrong = dict(tensors)
    wrong[ref] = [torch.zeros(3)]
    with pytest.raises(ValueError, match=r"final_norm box \[\(0, 64\)\]: expected torch.bfloat16"):
        ShardedState.from_tensors(TINY, layout, 0, wrong)
    assert set(region_boxes(TINY, layout, 0)) == set(tensors)


def test_a_released_state_refuses_use() -> None:
    state = ShardedState.seeded(TINY, Layout.create(TINY, ["solo"]), 0, 5, CPU)
    state.release()
    assert state.released
    with pytest.raises(RuntimeError, match="released by a committed switch"):
        state.get("embed")
