"""Dry run: the predicted pause follows the schedule's rounds and busiest members."""

from __future__ import annotations

import pytest

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout
from liveshard_core.plan.plan import build_plan
from liveshard_core.plan.predict import Links, predict
from liveshard_core.plan.schedule import build_schedule
from liveshard_core.vps.presets import preset

TINY = preset("tiny")


def test_prediction_by_hand() -> None:
    # tp=1 -> tp=2 adds n0, which receives 107072 elements * 14 bytes = 1499008 bytes from m0;
    # with a budget of that size it is one round in which m0 sends and n0 receives it all.
    plan = build_plan(TINY, Layout.create(TINY, ["m0"]), Layout.create(TINY, ["m0", "n0"], tp=2))
    schedule = build_schedule(plan, 1499008)
    p = predict(schedule, bandwidth=1e9, latency=0.002)
    assert p.rounds == len(schedule.rounds) == 1
    assert p.pause_seconds == pytest.approx(1499008 / 1e9 + 0.002)
    assert p.send_bytes == {0: 1499008} and p.recv_bytes == {1: 1499008}
    assert p.peak_buffer_bytes == 1499008
    # A smaller budget takes more rounds; the bytes stay the same, the latency adds up.
    small = predict(build_schedule(plan, 1 << 16), bandwidth=1e9, latency=0.002)
    assert small.rounds > 1 and small.peak_buffer_bytes <= 1 << 16
    assert small.pause_seconds == pytest.approx(1499008 / 1e9 + 0.002 * small.rounds)


def test_bad_rates() -> None:
    plan = build_plan(TINY, Layout.create(TINY, ["m0"]), Layout.create(TINY, ["m0"]))
    with pytest.raises(InvalidInput, match="bandwidth"):
        predict(build_schedule(plan, 1 << 20), bandwidth=0)


def test_bytes_inside_a_pod_cross_its_own_link() -> None:
    # The same switch with m0 and n0 in one pod: the bytes cross the pod's link, 10x faster; in
    # two pods (or pods not named), the network.
    plan = build_plan(TINY, Layout.create(TINY, ["m0"]), Layout.create(TINY, ["m0", "n0"], tp=2))
    schedule = build_schedule(plan, 1499008)
    one_pod = Links({"m0": "a", "n0": "a"}, local_bandwidth=1e10)
    inside = predict(schedule, bandwidth=1e9, latency=0.002, links=one_pod)
    assert inside.pause_seconds == pytest.approx(1499008 / 1e10 + 0.002)
    for pods in ({"m0": "a", "n0": "b"}, {"m0": "a"}):
        across = predict(schedule, bandwidth=1e9, latency=0.002, links=Links(pods, 1e10))
        assert across.pause_seconds == pytest.approx(1499008 / 1e9 + 0.002)
    # m0 leaves, n0 takes its place: what n0 takes from m0 inside their pod is faster.
    three = build_plan(
        TINY, Layout.create(TINY, ["m0", "m1"], tp=2), Layout.create(TINY, ["n0", "m1"], tp=2)
    )
    mixed = predict(build_schedule(three, 1 << 30), 1e9, 0.0, Links({"m0": "a", "n0": "a"}, 1e10))
    assert predict(build_schedule(three, 1 << 30), 1e9, 0.0).pause_seconds > mixed.pause_seconds
    with pytest.raises(InvalidInput, match="local bandwidth"):
        predict(schedule, bandwidth=1e9, links=Links({}, 0))
