"""The layout policy: feasible, best by the stated model, spares, and errors naming constraints."""

from __future__ import annotations

from pathlib import Path

import pytest

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.layout.region import place, rank_boxes
from liveshard_core.policy.layout import Constraints, choose_layout
from liveshard_core.policy.model import Hardware, Workload, estimate, state_bytes_per_layer
from liveshard_core.vps.box import volume
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import load_spec_file

LLAMA = preset("llama-70b")
QWEN = preset("qwen3-235b-a22b")


def test_layout_is_feasible_and_fits_memory() -> None:
    choice = choose_layout(LLAMA, 1000, Constraints(tp=8, global_batch=1920))
    d = choice.degrees
    layout = d.layout(LLAMA, [str(i) for i in range(d.world_size)])
    layout.check(LLAMA)
    assert d.tp == 8 and d.world_size <= 1000
    assert 1920 % (d.dp * 1) == 0
    assert choice.estimate.memory <= Hardware().memory
    assert choice.spares == tuple(range(d.world_size, 1000))
    assert choice.why and "feasible layouts" in choice.why[0]


def test_best_by_step_time_among_feasible() -> None:
    # Every other candidate of the same constraints is predicted slower (or does not fit).
    c = Constraints(tp=8, pp_max=8, global_batch=512)
    choice = choose_layout(LLAMA, 512, c)
    work = Workload(512)
    for pp in (1, 2, 4, 8):
        for dp in (1, 2, 4, 8, 16, 32, 64):
            if 8 * pp * dp > 512 or 512 % dp:
                continue
            other = parse_degrees(f"tp=8,pp={pp},dp={dp},zero=1")
            est = estimate(LLAMA, other.layout(LLAMA, [str(i) for i in range(other.world_size)]),
                           work, Hardware())  # fmt: skip
            if est.memory <= Hardware().memory:
                assert choice.estimate.step_seconds <= est.step_seconds


def test_moe_and_user_spec(tmp_path: Path) -> None:
    choice = choose_layout(QWEN, 1024, Constraints(tp=4, ep=8))
    assert choice.degrees.ep == 8 and choice.degrees.dp % 8 == 0
    path = tmp_path / "m.yaml"
    path.write_text("name: mine\nvocab: 32000\nhidden: 2048\nlayers: 12\nheads: 16\n"
                    "kv_heads: 4\nhead_dim: 128\nffn: 8192\n")  # fmt: skip
    mine = choose_layout(load_spec_file(path), 24, Constraints(global_batch=48))
    assert mine.degrees.world_size <= 24 and 48 % mine.degrees.dp == 0
    # 12 layers, heads 16, kv 4: tp divides 4 and pp at most 12.
    assert 4 % mine.degrees.tp == 0 and mine.degrees.pp <= 12


def test_from_a_current_layout_moves_few_bytes() -> None:
    current = parse_degrees("tp=8,pp=8,dp=16,zero=1")
    layout = current.layout(LLAMA, [str(i) for i in range(1024)])
    choice = choose_layout(LLAMA, 1016, Constraints(tp=8), current=layout)
    assert choice.bytes_to_move is not None and choice.members_to is not None
    assert len(choice.members_to) == choice.degrees.world_size
    assert len(choice.spares) == 1016 - choice.degrees.world_size


@pytest.mark.parametrize(
    ("members", "constraints", "hardware", "fragment"),
    [
        (8, Constraints(tp=8), Hardware(memory=1 << 30), "memory per device"),
        (16, Constraints(tp=3), Hardware(), "tp must divide heads"),
        (16, Constraints(tp=8, global_batch=7, micro_batch=2), Hardware(), "global batch 7"),
        (0, Constraints(), Hardware(), "members=0"),
        (4, Constraints(tp=8), Hardware(), r"tp=8 x pp=1 needs 8 members"),
    ],
)
def test_no_layout_names_the_constraint(
    members: int, constraints: Constraints, hardware: Hardware, fragment: str
) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        choose_layout(LLAMA, members, constraints, hardware)


@pytest.mark.parametrize(
    "degrees", ["dp=4,zero=1", "dp=4,zero=3", "dp=1,tp=2", "tp=2,zero=3", "tp=2,pp=2", "pp=4"]
)
def test_the_state_per_layer_counts_a_mirrored_shard_twice(degrees: str) -> None:
    # What the mirror adds to a member's layers is its predecessor's shards (without replicas:
    # its peer's boxes, along pp the previous stage's, round): the exact bytes of the layout's
    # regions (gradients, not in the state, are not mirrored).
    spec = preset("tiny")
    plain = parse_degrees(degrees)
    members = [f"m{i}" for i in range(plain.world_size)]
    mirrored = parse_degrees(f"{degrees},mirror=1").layout(spec, members)
    plain = plain.layout(spec, members)
    stage = (0 - 1) % mirrored.pp  # whose layers rank 0's copies are of
    first = sum(mirrored.pp_layers[:stage])
    copied = range(first, first + mirrored.pp_layers[stage])

    def exact(layout: Layout) -> int:
        return sum(
            volume(box) * spec.dtype(kind).itemsize
            for param in spec.params
            if param.layer is not None
            for kind in spec.kinds
            for box in rank_boxes(layout, place(spec, layout, param, kind), 0)
        )

    def estimated(layout: Layout) -> int:
        per_layer = state_bytes_per_layer(spec, layout)[0]
        return sum(per_layer[layer] for layer in copied)

    grown = estimated(mirrored) - estimated(plain)
    assert grown > 0
    assert grown == pytest.approx(exact(mirrored) - exact(plain), abs=spec.config.layers)


@pytest.mark.parametrize("per_pod", [2, 4])
def test_members_in_pods_keep_a_free_tp_inside_one(per_pod: int) -> None:
    # Left free, tp is 8 on these nodes; in pods of `per_pod` members it divides the pod.
    assert choose_layout(LLAMA, 512, Constraints(global_batch=512)).degrees.tp == 8
    for members in (64, 128, 512):
        choice = choose_layout(LLAMA, members, Constraints(global_batch=512, tp_divides=per_pod))
        assert per_pod % choice.degrees.tp == 0, (members, choice.degrees)
