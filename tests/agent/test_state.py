"""Single-process tests of sharded state: seeded content, views, layout-independent checksums."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="sharded state needs torch (the agent extra)")

from liveshard_agent.layout.layout import Layout  # noqa: E402
from liveshard_agent.state import (  # noqa: E402
    ShardedState,
    box_checksum,
    checksum_mask,
    seeded_box,
    state_bytes_of,
)
from liveshard_agent.vps.box import full_box  # noqa: E402
from liveshard_agent.vps.presets import preset  # noqa: E402
from liveshard_agent.vps.spec import ModelSpec, StateKind, TensorRef  # noqa: E402

CPU = torch.device("cpu")
TINY = preset("tiny")
MOE = preset("tiny-moe")


QKV = next(i for i, p in enumerate(TINY.params) if p.name == "layers.0.attn.qkv")  # [128, 64]


def names(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def total_checksums(spec: ModelSpec, layout: Layout, seed: int = 3) -> torch.Tensor:
    """What the union all-reduce adds up: every rank's designated contributions."""
    total = sum(
        ShardedState.seeded(spec, layout, r, seed, CPU).checksums()
        for r in range(layout.world_size)
    )
    assert isinstance(total, torch.Tensor)
    masks = [checksum_mask(spec.dtype(ref.kind).itemsize) for ref in spec.tensors()]
    return total & torch.tensor(masks).unsqueeze(1)


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


@pytest.mark.parametrize(
    ("spec", "kwargs", "n"),
    [
        (TINY, {"dp": 1}, 1),
        (TINY, {"dp": 2, "tp": 2, "zero": 1}, 4),
        (TINY, {"dp": 3, "zero": 3}, 3),
        (TINY, {"pp": 2, "dp": 2, "pp_layers": (1, 3)}, 4),
        (MOE, {"dp": 4, "ep": 2, "zero": 1}, 4),
        (MOE, {"tp": 2, "dp": 2, "ep": 2, "zero": 3}, 4),
    ],
)
def test_checksums_do_not_depend_on_the_layout(spec: ModelSpec, kwargs: dict, n: int) -> None:
    reference = total_checksums(spec, Layout.create(spec, ["solo"]))
    assert torch.equal(total_checksums(spec, Layout.create(spec, names(n), **kwargs)), reference)


def test_checksum_sees_a_changed_or_moved_value() -> None:
    t = seeded_box(TINY, TensorRef(QKV, StateKind.MASTER), ((0, 8), (0, 8)), 1, CPU)
    box = ((0, 8), (0, 8))
    base = box_checksum(t, box)
    changed = t.clone()
    changed[3, 4] += 1
    assert not torch.equal(box_checksum(changed, box), base)
    swapped_rows = t[[1, 0, *range(2, 8)]]
    assert not torch.equal(box_checksum(swapped_rows, box), base)
    swapped_cols = t[:, [1, 0, *range(2, 8)]]
    assert not torch.equal(box_checksum(swapped_cols, box), base)


def test_state_holds_the_region_and_reports_bytes() -> None:
    layout = Layout.create(TINY, names(4), dp=2, tp=2, zero=1)
    for rank in range(4):
        state = ShardedState.seeded(TINY, layout, rank, 5, CPU)
        assert state.matches_seed(5) == []
        assert state.matches_seed(6) != []
        assert state.nbytes == state_bytes_of(TINY, layout, rank)
    assert state_bytes_of(TINY, Layout.create(TINY, ["solo"]), 0) == TINY.state_bytes


def test_view_finds_the_piece_or_names_what_is_missing() -> None:
    layout = Layout.create(TINY, names(2), tp=2)
    state = ShardedState.seeded(TINY, layout, 1, 5, CPU)
    ref = TensorRef(0, StateKind.MASTER)  # embed [256, 64], tp splits dim 0: rank 1 has 128..256
    piece = ((130, 140), (0, 64))
    assert torch.equal(state.view(ref, piece), seeded_box(TINY, ref, piece, 5, CPU))
    with pytest.raises(KeyError, match="rank 1 holds no box of embed:master"):
        state.view(ref, ((0, 10), (0, 64)))
