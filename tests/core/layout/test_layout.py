"""Layouts: parsing degrees, feasibility checks and the rank <-> coordinates convention."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard_core.layout.layout import Degrees, Layout, parse_degrees
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec, TransformerConfig
from tests.helpers import names

TINY = preset("tiny")  # heads 4, kv_heads 2, ffn 192, vocab 256, 4 layers, dense
MOE = preset("tiny-moe")  # 8 experts of expert_ffn 48
# tp=4 divides heads and kv_heads (4) and ffn (8), but not vocab (10).
VOCAB10 = ModelSpec.from_config(
    TransformerConfig("v", vocab=10, hidden=4, layers=2, heads=4, kv_heads=4, head_dim=1, ffn=8)
)
# tp=4 divides heads, kv_heads and vocab (8), but not ffn (6).
FFN6 = ModelSpec.from_config(
    TransformerConfig("f", vocab=8, hidden=4, layers=2, heads=4, kv_heads=4, head_dim=1, ffn=6)
)


def test_parse_defaults() -> None:
    assert parse_degrees("") == Degrees(1, 1, 1, 1, 0, None)
    d = parse_degrees("tp=8,pp=8,dp=16,zero=1")
    assert (d.dp, d.tp, d.pp, d.ep, d.zero, d.pp_layers) == (16, 8, 8, 1, 1, None)
    assert d.world_size == 16 * 8 * 8
    assert parse_degrees(" dp = 2 , ep=2 ,") == Degrees(dp=2, ep=2)


def test_parse_pp_layers_infers_pp() -> None:
    d = parse_degrees("pp_layers=1:3")
    assert d.pp == 2
    assert d.pp_layers == (1, 3)
    layout = d.layout(TINY, names(2))
    assert layout.pp == 2
    assert layout.stage_of_layer == (0, 1, 1, 1)
    # An explicit pp that disagrees with pp_layers is caught when the layout is built.
    bad = parse_degrees("pp=3,pp_layers=1:3")
    assert bad.pp == 3
    with pytest.raises(ValueError, match="pp_layers"):
        bad.layout(TINY, names(3))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("dp=2,foo=3", "bad item 'foo=3'"),
        ("dp2", "bad item 'dp2'"),
        ("dp=2,dp=4", "dp given twice"),
        ("pp_layers=1:3,pp_layers=2:2", "pp_layers given twice"),
        ("tp=x", "tp='x' is not an integer"),
        ("zero=1.5", "zero='1.5' is not an integer"),
        ("pp_layers=1:a", "pp_layers='1:a' is not an integer"),
    ],
)
def test_parse_errors_name_the_key(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_degrees(text)
    assert fragment in str(err.value)
    assert repr(text) in str(err.value)


def test_default_pipeline_partition() -> None:
    cfg = TransformerConfig(
        "l7", vocab=8, hidden=4, layers=7, heads=2, kv_heads=1, head_dim=2, ffn=4
    )
    spec = ModelSpec.from_config(cfg)
    # 7 layers over 3 stages: 7 // 3 = 2 each, and 7 % 3 = 1 stage gets one more: 3, 2, 2.
    assert Layout.create(spec, names(3), pp=3).pp_layers == (3, 2, 2)
    # 7 over 4: 1 each plus 3 extra to the first three stages: 2, 2, 2, 1.
    layout = Layout.create(spec, names(4), pp=4)
    assert layout.pp_layers == (2, 2, 2, 1)
    assert layout.stage_of_layer == (0, 0, 1, 1, 2, 2, 3)
    assert Layout.create(spec, names(7), pp=7).pp_layers == (1,) * 7
    assert Layout.create(spec, names(1)).pp_layers == (7,)


@pytest.mark.parametrize(
    ("spec", "kwargs", "members", "fragments"),
    [
        (TINY, {"tp": 3}, 3, ["tp=3", "heads=4"]),
        (TINY, {"tp": 8}, 8, ["tp=8", "heads=4"]),
        (TINY, {"tp": 4}, 4, ["tp=4", "kv_heads=2"]),
        # heads 4, kv_heads 4 ok for tp=4; vocab 10 is not divisible by 2.
        (VOCAB10, {"tp": 4}, 4, ["tp=4", "vocab=10"]),
        (FFN6, {"tp": 4}, 4, ["tp=4", "ffn=6"]),
        (MOE, {"tp": 32}, 32, ["tp=32", "heads=4"]),
        (MOE, {"dp": 3, "ep": 2}, 3, ["ep=2", "dp=3"]),
        (MOE, {"dp": 3, "ep": 3}, 3, ["ep=3", "experts", "8"]),
        (TINY, {"dp": 2, "ep": 2}, 2, ["ep=2", "experts", "0"]),
        (TINY, {"pp": 5}, 5, ["pp=5", "4 layers"]),
        (TINY, {"pp": 0}, 1, ["pp=0"]),
        (TINY, {"pp": 2, "pp_layers": (1, 2, 1)}, 2, ["pp_layers=[1, 2, 1]", "pp=2"]),
        (TINY, {"pp": 2, "pp_layers": (1, 2)}, 2, ["pp_layers=[1, 2]", "sums to 3", "4 layers"]),
        (TINY, {"pp": 2, "pp_layers": (0, 4)}, 2, ["pp_layers=[0, 4]", "at least 1 layer"]),
        (TINY, {"dp": 2}, 3, ["3 members", "dp*tp*pp = 2"]),
        (TINY, {"zero": 2}, 1, ["zero=2"]),
        (TINY, {"zero": True}, 1, ["zero=True"]),
        (TINY, {"dp": 0}, 0, ["dp=0"]),
    ],
)
def test_create_errors_name_the_constraint(
    spec: ModelSpec, kwargs: dict[str, Any], members: int, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        Layout.create(spec, names(members), **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_create_takes_pp_from_pp_layers() -> None:
    layout = Layout.create(TINY, names(2), pp_layers=(3, 1))
    assert (layout.pp, layout.stage_of_layer) == (2, (0, 0, 0, 1))


def test_moe_tp_checks_expert_ffn_not_ffn() -> None:
    # In a MoE model the dense ffn is unused: tp must divide expert_ffn instead.
    cfg = TransformerConfig("m", vocab=8, hidden=4, layers=1, heads=4, kv_heads=4, head_dim=1,
                            ffn=3, experts=2, expert_ffn=4)  # fmt: skip
    spec = ModelSpec.from_config(cfg)
    assert Layout.create(spec, names(4), tp=4).tp == 4  # ffn=3 is not a constraint for MoE
    cfg2 = TransformerConfig("m2", vocab=8, hidden=4, layers=1, heads=4, kv_heads=4, head_dim=1,
                             ffn=4, experts=2, expert_ffn=2)  # fmt: skip
    with pytest.raises(ValueError, match="expert_ffn=2"):
        Layout.create(ModelSpec.from_config(cfg2), names(4), tp=4)


def test_duplicate_members() -> None:
    with pytest.raises(ValueError, match="twice"):
        Layout.create(TINY, ["a", "b", "a", "c"], dp=4)


def test_check_against_another_spec() -> None:
    layout = Layout.create(MOE, names(4), dp=4, ep=4)
    with pytest.raises(ValueError, match="ep=4"):
        layout.check(TINY)


def test_describe() -> None:
    layout = Layout.create(MOE, names(8), dp=4, tp=1, pp=2, ep=2, zero=3, pp_layers=(3, 1))
    assert layout.describe() == "dp=4,tp=1,pp=2,ep=2,zero=3,pp_layers=3:1"
    again = parse_degrees(layout.describe()).layout(MOE, names(8))
    assert again == layout


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_coords_rank_round_trip(dp: int, tp: int, pp: int) -> None:
    layout = Layout(dp, tp, pp, 1, 0, (1,) * pp, tuple(names(dp * tp * pp)))
    seen = set()
    for rank in range(layout.world_size):
        pp_i, dp_i, tp_i = layout.coords(rank)
        assert 0 <= pp_i < pp and 0 <= dp_i < dp and 0 <= tp_i < tp
        # The convention: tp fastest, then dp, then pp.
        assert rank == pp_i * dp * tp + dp_i * tp + tp_i
        assert layout.rank(pp_i, dp_i, tp_i) == rank
        seen.add((pp_i, dp_i, tp_i))
    assert len(seen) == layout.world_size
    for bad in (-1, layout.world_size):
        with pytest.raises(ValueError, match="outside"):
            layout.coords(bad)
