"""The job's progress series (`status.progress`), as the pure decision writes it: a sample for
each pass whose step advanced at least SAMPLE_SECONDS after the last sample (at once in a new
layout), its tokens per second from the time since then, every other sample dropped when the
series is full, and nothing written otherwise; and a write that changes only the progress is no
news to the job's loop."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from liveshard_operator.decide import decide
from liveshard_operator.publish import PROGRESS, SAMPLE_SECONDS, merge_patch
from liveshard_operator.world import Record

from tests.operator.values import NOW, broken, job, pod, seen, training, world

JOB = job(3)
WORLD = world(JOB, ["p0", "p1", "p2"], 1)
TOKENS_PER_STEP = 24 * 64  # the job's global batch x sequence length


def status(step: int, now: float = NOW, progress: list[dict[str, Any]] | None = None) -> Any:
    """The status a steady pass writes, its 3 members training at `step`."""
    body = {**JOB.body, "status": {"progress": progress}} if progress is not None else JOB.body
    pods = seen(*(pod(m, training(1, step=step), role="member") for m in WORLD.members))
    return decide(pods, Record(world=WORLD), replace(JOB, body=body), now).status


def test_each_pass_whose_step_advanced_adds_a_sample_with_its_rate() -> None:
    first = status(10)
    assert first["phase"] == "Running"
    assert first["progress"] == [{
        "time": "1970-01-12T13:46:40.000Z", "step": 10, "loss": 2.5, "members": 3,
        "layout": WORLD.describe(),
    }]  # fmt: skip  # no rate yet: nothing to measure it from
    second = status(12, NOW + 4, first["progress"])["progress"]
    assert second[0] == first["progress"][0]
    assert second[1]["time"] == "1970-01-12T13:46:44.000Z" and second[1]["step"] == 12
    assert second[1]["tokensPerSecond"] == 2 * TOKENS_PER_STEP / 4


def test_a_pass_whose_step_did_not_advance_leaves_the_series_alone() -> None:
    series = status(10)["progress"]
    for step in (10, 7):  # the same step; an earlier one (restored from a checkpoint)
        again = status(step, NOW + 2, series)
        assert "progress" not in again and again["step"] == step
    assert "progress" not in status(0)  # nothing trained yet


def test_samples_of_one_layout_are_a_second_apart_and_a_clock_set_back_gives_no_rate() -> None:
    series = status(10)["progress"]
    assert "progress" not in status(11, NOW + SAMPLE_SECONDS / 2, series)
    assert len(status(11, NOW + SAMPLE_SECONDS, series)["progress"]) == 2
    # Unless the layout changed: its first sample is the pass that saw the reconfiguration end.
    resized = [{**series[0], "layout": "dp=4,tp=1,pp=1,ep=1,zero=1", "members": 4}]
    taken = status(11, NOW + SAMPLE_SECONDS / 2, resized)["progress"]
    assert taken[-1]["layout"] == WORLD.describe() and taken[-1]["tokensPerSecond"] > 0
    behind = status(11, NOW - 60, series)["progress"]  # an operator whose clock is behind
    assert behind[-1]["step"] == 11 and "tokensPerSecond" not in behind[-1]


def test_a_full_series_drops_every_other_sample_and_keeps_the_whole_span() -> None:
    full = [{"time": "1970-01-12T13:46:40.000Z", "step": s, "loss": 3.0, "members": 3,
             "layout": WORLD.describe()} for s in range(1, PROGRESS + 1)]  # fmt: skip
    series = status(PROGRESS + 5, NOW + 10, full)["progress"]
    assert len(series) == PROGRESS // 2 + 1
    assert [s["step"] for s in series] == [*range(1, PROGRESS + 1, 2), PROGRESS + 5]
    assert series[-1]["tokensPerSecond"] == 5 * TOKENS_PER_STEP / 10


def test_the_loss_is_of_a_member_that_trained_a_step() -> None:
    """A member that joined in this world reports no loss (0) until its first step: the status
    takes the next member's, and with none known takes no sample, rather than a fall to 0."""
    joined, stayed = training(1, step=10), training(1, step=10)
    joined.loss, stayed.loss = 0.0, 3.25
    pods = seen(pod("p0", joined, role="member"), pod("p1", stayed, role="member"),
                pod("p2", stayed, role="member"))  # fmt: skip
    out = decide(pods, Record(world=WORLD), JOB, NOW).status
    assert out["loss"] == 3.25 and out["progress"][-1]["loss"] == 3.25
    fresh = seen(*(pod(m, joined, role="member") for m in WORLD.members))  # a first world
    out = decide(fresh, Record(world=WORLD), JOB, NOW).status
    assert "loss" not in out and "progress" not in out and out["step"] == 10


def test_a_write_that_only_moves_the_progress_is_no_news_and_any_other_change_is() -> None:
    def steady(step: int, before: dict[str, Any], now: float, last: Any = training) -> Any:
        agents = [training(1, step=step), training(1, step=step), last(1, step=step)]
        pods = seen(*(pod(m, a, role="member") for m, a in zip(WORLD.members, agents, strict=True)))
        return decide(pods, Record(world=WORLD), replace(JOB, body={**JOB.body, "status": before}),
                      now)  # fmt: skip

    first = steady(10, {}, NOW)
    assert first.news  # the first status
    written = merge_patch({}, first.status)
    again = steady(14, written, NOW + 4)
    assert again.status["step"] == 14 and len(again.status["progress"]) == 2
    assert not again.news  # the step, the loss and a sample more: the loop is not woken by it
    assert not steady(10, written, NOW + 1).news  # nothing changed at all
    # A member whose world broke: the ready replicas and the conditions change.
    assert steady(14, written, NOW + 4, broken).news
