"""Single-process tests of the checksum format: layout independence and sensitivity."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="checksums need torch (the agent extra)")

from liveshard_agent.engine.checksum import Checksums, box_checksum  # noqa: E402
from liveshard_agent.engine.state import ShardedState, seeded_box  # noqa: E402
from liveshard_core.layout.layout import Layout  # noqa: E402
from liveshard_core.vps.presets import preset  # noqa: E402
from liveshard_core.vps.spec import DType, ModelSpec, StateKind, TensorRef  # noqa: E402
from tests.helpers import names  # noqa: E402

CPU = torch.device("cpu")
TINY = preset("tiny")
MOE = preset("tiny-moe")
TINY_FP32 = ModelSpec.from_config(dataclasses.replace(TINY.config, param_dtype=DType.FP32))
QKV = TINY.ref("layers.0.attn.qkv").param  # [128, 64]


def total(spec: ModelSpec, layout: Layout, seed: int = 3) -> Checksums:
    """What the union all-reduce adds up: every rank's designated contributions."""
    sums = sum(
        Checksums.of_state(ShardedState.seeded(spec, layout, r, seed, CPU)).sums
        for r in range(layout.world_size)
    )
    assert isinstance(sums, torch.Tensor)
    return Checksums(spec, sums)


@pytest.mark.parametrize(
    ("spec", "kwargs", "n"),
    [
        (TINY, {"dp": 1}, 1),
        (TINY, {"dp": 2, "tp": 2, "zero": 1}, 4),
        (TINY, {"dp": 3, "zero": 3}, 3),
        (TINY, {"pp": 2, "dp": 2, "pp_layers": (1, 3)}, 4),
        (TINY_FP32, {"tp": 2, "dp": 2, "zero": 3}, 4),
        (MOE, {"dp": 4, "ep": 2, "zero": 1}, 4),
        (MOE, {"tp": 2, "dp": 2, "ep": 2, "zero": 3}, 4),
    ],
)
def test_checksums_do_not_depend_on_the_layout(spec: ModelSpec, kwargs: dict, n: int) -> None:
    reference = total(spec, Layout.create(spec, ["solo"]))
    other = total(spec, Layout.create(spec, names(n), **kwargs))
    assert torch.equal(other.reduced(), reference.reduced())
    assert other.differing(reference) == []
    # A different seed shifts every value slightly: every fp32 tensor's checksum differs (a
    # shift below bf16's precision leaves some bf16 tensors' bits unchanged).
    changed = set(total(spec, Layout.create(spec, ["solo"]), seed=4).differing(reference))
    assert {r for r in spec.tensors() if spec.dtype(r.kind) is DType.FP32} <= changed


def test_differing_names_the_changed_tensor() -> None:
    layout = Layout.create(TINY, names(2), dp=2, zero=1)
    states = [ShardedState.seeded(TINY, layout, r, 3, CPU) for r in range(2)]
    before = Checksums(TINY, sum(Checksums.of_state(s).sums for s in states))
    ref = TINY.ref("layers.1.mlp.down", StateKind.EXP_AVG)
    states[1].boxes_of(ref)[0][1][0, 0] += 1  # rank 1 holds rows of its shard
    after = Checksums(TINY, sum(Checksums.of_state(s).sums for s in states))
    assert before.differing(after) == [ref]
    flat = Checksums.from_flat(TINY, after.flat)
    assert torch.equal(flat.sums, after.sums)


def test_box_checksum_sees_a_changed_or_moved_value() -> None:
    box = ((0, 8), (0, 8))
    t = seeded_box(TINY, TensorRef(QKV, StateKind.MASTER), box, 1, CPU)
    base = box_checksum(t, box)
    changed = t.clone()
    changed[3, 4] += 1
    assert not torch.equal(box_checksum(changed, box), base)
    swapped_rows = t[[1, 0, *range(2, 8)]]
    assert not torch.equal(box_checksum(swapped_rows, box), base)
    swapped_cols = t[:, [1, 0, *range(2, 8)]]
    assert not torch.equal(box_checksum(swapped_cols, box), base)
