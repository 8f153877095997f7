"""Live pipeline rebalancing in the reconcile pass (`rebalance`, called from `decide`): the costs
the agents report decide a rebalance, a pack or a grow; a rebalanced or packed world is kept; the
state rebalancing keeps round-trips through the status; the CRD's `spec.rebalance` schema. Pure:
the agents' statuses are the proto messages they would send; no cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from liveshard_operator import render
from liveshard_operator.actions import Begin, Checkpoint, CreatePod, DeletePod, Event, ReleaseMember
from liveshard_operator.decide import decide
from liveshard_operator.decision import Decision
from liveshard_operator.observation import Job, Observation
from liveshard_operator.world import InFlight, Rebalancing, Record, World

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput
from liveshard_core.job import JobConfig
from liveshard_core.job.rebalance import RebalanceSettings
from liveshard_core.layout.layout import Degrees
from tests.operator.values import NOW, job, pod, seen, standby, switch, switched, training, world

ROOT = Path(__file__).resolve().parents[2]
M = render.MEMBER
MEMBERS = [f"p{i}" for i in range(8)]
ON = {"enabled": True}
J8 = job(8, rebalance=ON)  # the policy gives 8 members dp=4, pp=2 (2:2) of tiny's 4 layers
PACKING = job(8, rebalance={**ON, "pack": True})
W8 = world(J8, MEMBERS, 1)
# Layer 3 takes three times the others: 2:2 paces the step at 0.4 s a micro-batch round, 3:1
# at 0.3 s (imbalance 1.33 -> 1.0; 25% of the step won).
SLOW_LAST = [0.1, 0.1, 0.1, 0.3]
# Layer 3 is nearly all the work: one stage runs the step as fast as two (a pack).
ONE_HEAVY = [0.01, 0.01, 0.01, 1.0]
EVEN = [0.25, 0.25, 0.25, 0.25]


def costs(layers: list[float], steps: int = 10, imbalance: float = 1.0) -> pb.Costs:
    return pb.Costs(layer_seconds=layers, steps=steps, imbalance=imbalance)


def of(degrees: Degrees, members: list[str], epoch: int) -> World:
    return World.of(epoch, degrees.layout(J8.model, members))


def trains(the_world: World, measured: pb.Costs | None, *more: Any) -> Observation:
    """Every member of `the_world` training in its epoch, its switch into it accounted for,
    reporting `measured`; `more` pods."""
    fields = {"costs": measured} if measured is not None else {}
    members = (pod(m, switched(the_world.epoch, **fields), role=M) for m in the_world.members)
    return seen(*members, *more)


def began(decision: Decision) -> InFlight:
    assert isinstance(decision.ask, Begin), decision.ask
    return decision.ask.plan


def events(decision: Decision) -> list[str]:
    return [a.reason for a in decision.after if isinstance(a, Event)]


# ---- rebalance ----


def test_a_full_window_over_the_threshold_rebalances_to_the_balanced_partition() -> None:
    decision = decide(trains(W8, costs(SLOW_LAST, imbalance=1.333)), Record(world=W8), J8, NOW)
    plan = began(decision)
    assert plan.reason.startswith("rebalance: imbalance 1.33 -> 1.00, step 0.533 s -> 0.4 s")
    assert plan.new.degrees == Degrees(dp=4, tp=1, pp=2, ep=1, zero=1, pp_layers=(3, 1))
    assert plan.new.members == W8.members and plan.old == W8 and plan.epoch == 2
    assert events(decision) == ["Rebalance"]
    assert decision.status["imbalance"] == 1.333


@pytest.mark.parametrize(
    ("the_job", "measured"),
    [
        (job(8, rebalance={**ON, "threshold": 0.3}), costs(SLOW_LAST)),  # 25% < 30%
        (J8, costs(SLOW_LAST, steps=9)),  # the window is not full yet
        (J8, None),  # nothing measured in this world yet
        (job(8), costs(SLOW_LAST)),  # rebalancing is off
        (J8, costs([0.1, 0.1, 0.1, 0.1])),  # balanced already
    ],
    ids=["under the threshold", "window not full", "not measured", "disabled", "balanced"],
)
def test_nothing_begins(the_job: Job, measured: pb.Costs | None) -> None:
    decision = decide(trains(W8, measured), Record(world=W8), the_job, NOW)
    assert decision.ask is None and decision.after == () and decision.record == Record(world=W8)
    assert decision.status["phase"] == "Running"


def test_no_rebalance_in_a_pass_that_asks_for_a_checkpoint_or_after_an_abort() -> None:
    checkpointing = job(8, rebalance=ON, checkpoint={"path": "/ck", "everySteps": 5})
    due = decide(trains(W8, costs(SLOW_LAST)), Record(world=W8, checkpoint_asked=2),
                 checkpointing, NOW)  # fmt: skip
    assert isinstance(due.ask, Checkpoint) and events(due) == []
    asked = Record(world=W8, checkpoint_asked=3)  # at step 15; the members are at step 10
    assert began(decide(trains(W8, costs(SLOW_LAST)), asked, checkpointing, NOW))
    backing_off = Record(world=W8, attempts=1, retry_after=NOW + 5)
    assert decide(trains(W8, costs(SLOW_LAST)), backing_off, J8, NOW).ask is None


def test_a_rebalanced_world_is_kept() -> None:
    rebalanced = of(Degrees(dp=4, pp=2, zero=1, pp_layers=(3, 1)), MEMBERS, 2)
    for the_job in (J8, job(8)):  # whether or not rebalancing is still on
        for measured in (None, costs(SLOW_LAST, steps=3), costs(SLOW_LAST)):
            decision = decide(trains(rebalanced, measured), Record(world=rebalanced), the_job,
                              NOW)  # fmt: skip
            assert decision.ask is None and decision.after == (), (the_job, measured)


def test_a_partition_left_before_needs_twice_the_threshold() -> None:
    rebalanced = of(Degrees(dp=4, pp=2, zero=1, pp_layers=(3, 1)), MEMBERS, 2)
    # Layer 2 grew: 3:1 paces at 0.4 s, 2:2 at 0.3 s: 25% won.
    seen_ = trains(rebalanced, costs([0.1, 0.1, 0.2, 0.1]))
    left = Record(world=rebalanced, rebalance=Rebalancing(left=((2, 2),)))
    fifteen = job(8, rebalance={**ON, "threshold": 0.15})
    assert decide(seen_, left, fifteen, NOW).ask is None  # 25% <= 2 x 15%
    assert began(decide(seen_, replace(left, rebalance=Rebalancing()), fifteen, NOW)).new.degrees \
        .pp_layers == (2, 2)  # fmt: skip
    assert began(decide(seen_, left, J8, NOW)).new.degrees.pp_layers == (2, 2)  # 25% > 2 x 10%


def test_a_committed_rebalance_remembers_the_partition_it_left() -> None:
    new = of(Degrees(dp=4, pp=2, zero=1, pp_layers=(3, 1)), MEMBERS, 2)
    plan = InFlight(2, "rebalance: imbalance 1.33 -> 1.00", new, ("10.0.0.0", 7000), NOW - 5, W8)
    ended = trains(new, None)
    decision = decide(ended, Record(world=W8, in_flight=plan, last_epoch=2), J8, NOW)
    assert decision.record.world == new and decision.record.rebalance.left == ((2, 2),)
    assert decision.status["rebalance"] == {"left": [[2, 2]], "replicas": None, "grow": None}
    # At most the last 8 are kept, each once.
    state = Rebalancing(left=tuple((i, 4 - i) for i in range(1, 4)) * 3)
    assert state.leaving((1, 3)).left[-1] == (1, 3) and len(state.leaving((9,)).left) <= 8


# ---- pack and grow ----

PACKED = of(Degrees(dp=4, pp=1, zero=1, pp_layers=(4,)), MEMBERS[4:], 2)
RELEASED = tuple(MEMBERS[:4])
PACKED_STATE = Rebalancing(left=((2, 2),), released=RELEASED, replicas=8)
PACKED_RECORD = Record(world=PACKED, last_epoch=2, rebalance=PACKED_STATE)


def test_pack_runs_on_fewer_stages_and_releases_the_others() -> None:
    decision = decide(trains(W8, costs(ONE_HEAVY)), Record(world=W8), PACKING, NOW)
    plan = began(decision)
    assert plan.reason.startswith("pack: 2 -> 1 stages, releasing 4 member(s); ")
    assert plan.new.degrees == PACKED.degrees and len(plan.new.members) == 4
    assert events(decision) == ["Pack"]
    # Committed: the members left are released and their pods deleted, as in a scale-down.
    plan = replace(plan, epoch=2, new=PACKED, store=("10.0.0.0", 7000))
    there = seen(
        *(pod(m, switched(2) if m in PACKED.members else training(1), role=M) for m in MEMBERS)
    )
    decision = decide(there, Record(world=W8, in_flight=plan, last_epoch=2), PACKING, NOW)
    assert decision.record.world == PACKED
    assert decision.record.rebalance == PACKED_STATE
    gone = [a.member if isinstance(a, ReleaseMember) else a.pod for a in decision.after
            if isinstance(a, ReleaseMember | DeletePod)]  # fmt: skip
    assert sorted(gone) == sorted([*RELEASED, *RELEASED])
    assert decision.status["released"] == list(RELEASED) and decision.status["replicas"] == 4


def test_a_packed_job_is_not_scaled_back_to_its_replicas() -> None:
    packed = PACKED_RECORD
    for measured in (None, costs(ONE_HEAVY)):
        decision = decide(trains(PACKED, measured), packed, PACKING, NOW)
        assert decision.ask is None and decision.after == () and decision.record == packed
        assert decision.status["released"] == list(RELEASED)


@pytest.mark.parametrize(
    "the_job",
    [job(6, rebalance={**ON, "pack": True}), job(8, rebalance={**ON, "pack": False})],
    ids=["replicas changed", "packing turned off"],
)
def test_packing_ends_when_the_spec_no_longer_stands_for_it(the_job: Job) -> None:
    packed = PACKED_RECORD
    decision = decide(trains(PACKED, None), packed, the_job, NOW)
    assert decision.record.rebalance == Rebalancing(left=((2, 2),))
    creates = [a for a in decision.after if isinstance(a, CreatePod)]
    assert len(creates) == the_job.spec.replicas - 4  # scaled as any job


def test_a_fixed_pp_is_never_packed() -> None:
    fixed = job(4, rebalance={**ON, "pack": True}, parallelism={"zero": 1, "pp": 2})
    four = world(fixed, MEMBERS[:4], 1)
    assert decide(trains(four, costs(ONE_HEAVY)), Record(world=four), fixed, NOW).ask is None


def test_a_pack_must_fit_the_pods_memory() -> None:
    # tiny's state at dp=4: 0.49 MB a layer, 0.16 MB the embedding and the head: 2.3 MB on one
    # stage, 1.15 MB on each of two.
    container = {"name": "agent", "resources": {"limits": {"memory": "2M"}}}
    capped = job(8, rebalance={**ON, "pack": True}, template={"spec": {"containers": [container]}})
    assert capped.spec.memory_limit() == 2_000_000
    assert decide(trains(W8, costs(ONE_HEAVY)), Record(world=W8), capped, NOW).ask is None


def test_grow_creates_pods_then_switches_to_more_stages_on_them() -> None:
    packed = PACKED_RECORD
    # The work spread out again: two stages would run the step a third faster.
    first = decide(trains(PACKED, costs(EVEN)), packed, PACKING, NOW)
    assert first.ask is None and events(first) == ["Grow"]
    assert first.record.rebalance.grow == (2, 2)
    assert "waiting for 4 pod(s) to be ready" in first.report.message
    # The next pass creates the pods (the job's size counts them), and waits for them.
    second = decide(trains(PACKED, costs(EVEN)), first.record, PACKING, NOW)
    assert [type(a) for a in second.after] == [CreatePod] * 4 and second.ask is None
    landing = [pod(f"q{i}", None, since=NOW - 1) for i in range(4)]
    third = decide(trains(PACKED, costs(EVEN), *landing), first.record, PACKING, NOW)
    assert third.ask is None and "pre-warming 4 pod(s)" in third.report.message
    # Ready: the grow begins on them.
    ready = [pod(f"q{i}", standby()) for i in range(4)]
    fourth = decide(trains(PACKED, costs(EVEN), *ready), first.record, PACKING, NOW)
    plan = began(fourth)
    assert plan.reason.startswith("grow: 1 -> 2 stages on 4 new member(s); ")
    assert plan.new.degrees.pp_layers == (2, 2)
    assert sorted(plan.new.members) == sorted([*PACKED.members, "q0", "q1", "q2", "q3"])
    assert events(fourth) == ["Grow"]
    # Committed: the members taken back are released no more.
    plan = replace(plan, store=("10.0.0.0", 7000))
    joined = seen(*(pod(m, switched(3), role=M) for m in plan.new.members))
    done = decide(joined, replace(first.record, in_flight=plan, last_epoch=3), PACKING, NOW)
    assert done.record.world == plan.new
    assert done.record.rebalance == Rebalancing(left=((2, 2), (4,)))
    assert done.status["released"] is None and done.status["replicas"] == 8


def test_only_a_packed_job_grows() -> None:
    # 4 of 8 pods cannot be scheduled: the world of the 4 others is not packed, and whatever
    # its costs, rebalancing adds no stage (the job grows as its pods land).
    four = world(PACKING, MEMBERS[4:], 1)
    missing = [pod(m, None, unschedulable="Unschedulable: no node") for m in MEMBERS[:4]]
    decision = decide(trains(four, costs(EVEN), *missing), Record(world=four), PACKING, NOW)
    assert decision.ask is None and events(decision) == []
    assert decision.record.rebalance == Rebalancing()


def test_a_grow_the_costs_no_longer_call_for_is_dropped() -> None:
    growing = Record(world=PACKED, last_epoch=2, rebalance=Rebalancing(
        released=RELEASED, replicas=8, grow=(2, 2)))  # fmt: skip
    decision = decide(trains(PACKED, costs(ONE_HEAVY)), growing, PACKING, NOW)
    assert decision.ask is None and decision.record.rebalance.grow == ()


def test_a_first_world_ends_the_packing() -> None:
    first = World.of(3, PACKED.layout(J8.model))
    plan = InFlight(3, "restore from /ck/step-9", first, ("10.0.0.0", 7000), NOW - 5)
    packed = Record(last_epoch=3, in_flight=plan, rebalance=PACKED_STATE)
    committed = decide(trains(first, None), packed, PACKING, NOW)
    assert committed.record.rebalance == Rebalancing(left=((2, 2),))


# ---- the state in status ----


def test_the_state_round_trips_through_the_status() -> None:
    state = Rebalancing(left=((2, 2), (3, 1)), released=("p0", "p1"), replicas=8, grow=(1, 3))
    record = Record(world=PACKED, rebalance=state)
    status = {"reconfiguration": record.to_dict(), **state.to_status()}
    assert Record.from_status(status) == record
    assert Rebalancing().to_status() == {"rebalance": None, "released": None}
    assert Record.from_status({}) == Record()


def test_the_imbalance_is_the_worlds_measured_one() -> None:
    speaker_silent = seen(pod("p0", None, role=M),
                          *(pod(m, training(1, costs=costs(SLOW_LAST, 3, 1.25)), role=M)
                            for m in MEMBERS[1:]))  # fmt: skip
    assert decide(speaker_silent, Record(world=W8), J8, NOW).status["imbalance"] == 1.25
    old_epoch = trains(replace(W8, epoch=0), costs(SLOW_LAST, 3, 1.25))
    assert decide(old_epoch, Record(world=W8), J8, NOW).status["imbalance"] is None


def test_an_aborted_rebalance_is_retried_after_the_backoff() -> None:
    new = of(Degrees(dp=4, pp=2, zero=1, pp_layers=(3, 1)), MEMBERS, 2)
    plan = InFlight(2, "rebalance: x", new, ("10.0.0.0", 7000), NOW - 5, W8)
    aborted = training(1, costs=costs(SLOW_LAST), last_switch=switch(2, pb.SwitchSummary.ABORTED))
    there = seen(*(pod(m, aborted, role=M) for m in MEMBERS))
    decision = decide(there, Record(world=W8, in_flight=plan, last_epoch=2), J8, NOW)
    assert decision.record.in_flight is None and decision.record.rebalance == Rebalancing()
    assert decide(there, decision.record, J8, NOW).ask is None  # backing off
    retried = decide(there, decision.record, J8, decision.record.retry_after)
    assert began(retried).epoch == 3


# ---- spec.rebalance: the CRD and the operator read it alike ----


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "elastictrainingjobs.liveshard.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return dict(spec["properties"]["rebalance"])


def _refused(value: dict[str, Any]) -> list[str]:
    """What the API server's structural checks of `spec.rebalance` say against `value` (the
    schema's own keywords: types, bounds and unknown fields)."""
    schema, errors = _schema(), []
    types = {"boolean": bool, "integer": int, "number": (int, float)}
    for key, item in value.items():
        prop = schema["properties"].get(key)
        if prop is None:
            errors.append(f"unknown field {key}")
            continue
        if not isinstance(item, types[prop["type"]]) or (
            prop["type"] != "boolean" and isinstance(item, bool)
        ):
            errors.append(f"{key}: type")
            continue
        if "minimum" in prop and (item < prop["minimum"] or (
                prop.get("exclusiveMinimum") and item == prop["minimum"])):  # fmt: skip
            errors.append(f"{key}: minimum")
        if "maximum" in prop and (item > prop["maximum"] or (
                prop.get("exclusiveMaximum") and item == prop["maximum"])):  # fmt: skip
            errors.append(f"{key}: maximum")
    return errors


def test_the_crd_defaults_are_the_settings_defaults() -> None:
    props = _schema()["properties"]
    defaults = RebalanceSettings()
    assert {k: p["default"] for k, p in props.items()} == {
        "enabled": defaults.enabled, "threshold": defaults.threshold,
        "windowSteps": defaults.window_steps, "pack": defaults.pack,
    }  # fmt: skip
    assert job(2).spec.rebalance == defaults


@pytest.mark.parametrize(
    "value",
    [{}, {"enabled": True}, {"threshold": 0.5, "windowSteps": 1, "pack": True},
     {"threshold": 0.999}, {"threshold": 1e-3}],
)  # fmt: skip
def test_the_schema_and_the_operator_accept(value: dict[str, Any]) -> None:
    assert _refused(value) == []
    spec = job(2, rebalance=value).spec
    assert spec.rebalance.window_steps == value.get("windowSteps", 10)
    assert spec.rebalance.enabled is value.get("enabled", False)
    # The agents read the same settings from their configuration (they measure over the window).
    assert JobConfig.from_json(spec.agent_config()).rebalance == spec.rebalance


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"threshold": 0}, "threshold: minimum"),
        ({"threshold": 1}, "threshold: maximum"),
        ({"threshold": -0.1}, "threshold: minimum"),
        ({"windowSteps": 0}, "windowSteps: minimum"),
        ({"windowSteps": 2.5}, "windowSteps: type"),
        ({"enabled": "yes"}, "enabled: type"),
        ({"window": 10}, "unknown field window"),
    ],
)
def test_the_schema_and_the_operator_refuse(value: dict[str, Any], error: str) -> None:
    assert _refused(value) == [error]
    with pytest.raises(InvalidInput, match=r"spec\.rebalance"):
        job(2, rebalance=value)
