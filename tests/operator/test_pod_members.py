"""Pods of several members (one per GPU, `spec.membersPerPod` on CPUs): the spec counts pods, the
operator sees and places members, and a pod's members join and leave together. The decisions
are the pure pass's; the agents' side (one endpoint per pod) is tested in
tests/agent/server/test_pod.py and the whole on the local cluster in tests/e2e."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import grpc
import pytest
from liveshard_operator import policy, render
from liveshard_operator.actions import (
    Action,
    Begin,
    Checkpoint,
    CommitOn,
    CreatePod,
    DeletePod,
    LabelPod,
    Prepare,
    ReleaseMember,
)
from liveshard_operator.agents import AgentError
from liveshard_operator.decide import decide
from liveshard_operator.decision import Decision, hosted
from liveshard_operator.observation import Job, Observation, Pod
from liveshard_operator.world import InFlight, Record, World

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.assign.nodes import mirror_pairs, pairs_on_one_node
from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Layout, parse_degrees
from tests.operator.test_act import Calls, FakeAgent, executor, kinds
from tests.operator.values import NOW, job, pod, seen, standby, switched, training

TP2 = {"parallelism": {"tp": 2, "zero": 1}}


def gpus(count: int | str) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "agent", "resources": {
        "limits": {"nvidia.com/gpu": count, "cpu": "8"}}}]}}  # fmt: skip


def two_per_pod(replicas: int, **spec: Any) -> Job:
    return job(replicas, membersPerPod=2, **{**TP2, **spec})


def members(name: str, agent: pb.AgentStatus | None, count: int = 2, **fields: Any) -> list[Pod]:
    """The members of pod `name`, as observe sees them: each named `<pod>-<k>`."""
    one = pod(name, agent, **fields)
    return [replace(one, name=f"{name}-{k}", pod=name) for k in range(count)]


def leaving(actions: tuple[Action, ...]) -> list[Action]:
    """The releases and deletions of `actions` (the agents' calls run before the deletions)."""
    calls = [a for a in actions if isinstance(a, ReleaseMember)]
    return calls + [a for a in actions if isinstance(a, DeletePod)]


def pods(*groups: list[Pod]) -> Observation:
    return seen(*(p for group in groups for p in group))


def test_the_spec_counts_pods_of_one_member_per_gpu() -> None:
    spec = job(3, minReplicas=2, maxReplicas=4, template=gpus(2), device="cpu").spec
    assert spec.members_per_pod == 2
    assert (spec.replicas, spec.min_replicas, spec.max_replicas) == (6, 4, 8)
    assert spec.pods(spec.replicas) == 3 and spec.pods(5) == 3
    assert job(3).spec.members_per_pod == 1 and job(3).spec.replicas == 3
    assert job(3, template=gpus(4)).spec.device == "cuda"


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"membersPerPod": 0}, "spec.membersPerPod=0 must be an integer >= 1"),
        ({"membersPerPod": 3, "template": gpus(2)}, "must equal the worker container's "
                                                    "nvidia.com/gpu=2: a member per device"),
        ({"template": gpus("two")}, "nvidia.com/gpu='two' must be a whole number"),
        ({"membersPerPod": 3, "parallelism": {"tp": 2}}, "spec.parallelism.tp=2 must divide the "
                                                         "3 members of a pod"),
    ],
)  # fmt: skip
def test_a_pod_shape_the_job_cannot_have_is_refused(spec: dict[str, Any], error: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(error)):
        job(2, **spec)


def test_a_pod_of_several_members_is_rendered_for_its_supervisor() -> None:
    the_job = job(2, template=gpus(2), device="cpu")
    rendered = render.worker_pod(the_job.body, the_job.spec)
    env = {e["name"]: e.get("value") for e in rendered["spec"]["containers"][0]["env"]}
    assert env["LIVESHARD_POD_MEMBERS"] == "2"
    assert env["OMP_NUM_THREADS"] == "4"  # the pod's 8 CPUs shared by its 2 members
    assert rendered["metadata"]["annotations"][render.MEMBERS_ANNOTATION] == "2"
    named = {**rendered, "metadata": {**rendered["metadata"], "name": "tiny-x1"}}
    assert render.pod_members(named) == ["tiny-x1-0", "tiny-x1-1"]
    one = render.worker_pod(job(2).body, job(2).spec)
    assert "LIVESHARD_POD_MEMBERS" not in str(one) and render.MEMBERS_ANNOTATION not in str(one)
    assert render.pod_members({**one, "metadata": {"name": "tiny-x2"}}) == ["tiny-x2"]


def test_a_gang_of_pods_asks_for_the_pods_of_min_replicas() -> None:
    spec = two_per_pod(3, minReplicas=2, scheduling={"gang": True}).spec
    assert render.pod_group(job(3).body, spec)["spec"]["minMember"] == 2


def test_the_first_world_puts_each_tensor_parallel_group_inside_a_pod() -> None:
    the_job = two_per_pod(2)
    # Two pods ready, listed against their order: each pod's members take neighbouring ranks.
    decision = decide(pods(members("p1", standby()), members("p0", standby())),
                      Record(), the_job, NOW)  # fmt: skip
    assert isinstance(decision.ask, Begin)
    new = decision.ask.plan.new
    assert new.degrees.tp == 2
    groups = [new.members[i : i + 2] for i in range(0, len(new.members), 2)]
    assert sorted(groups) == [("p0-0", "p0-1"), ("p1-0", "p1-1")]


def test_missing_members_are_made_up_by_whole_pods_and_counted_as_pods() -> None:
    the_job = two_per_pod(3)
    decision = decide(pods(members("p0", standby())), Record(), the_job, NOW)
    assert [a for a in decision.after if isinstance(a, CreatePod)] == [
        CreatePod(render.worker_pod(the_job.body, the_job.spec))
    ] * 2


def _training(epoch: int, names: str) -> Observation:
    return pods(*(members(n, training(epoch), role=render.MEMBER) for n in names.split()))


def test_a_shrink_takes_whole_pods_and_deletes_each_once() -> None:
    three = two_per_pod(3)
    old = World.of(1, _layout(three, "p0 p1 p2"))
    # Scaled to 2 pods: the newest pod's two members leave; its pod is deleted once, after.
    two = two_per_pod(2)
    decision = decide(_training(1, "p0 p1 p2"), Record(world=old), two, NOW)
    assert isinstance(decision.ask, Begin)
    plan = decision.ask.plan
    assert sorted(plan.new.members) == ["p0-0", "p0-1", "p1-0", "p1-1"]
    assert plan.reason == "scale 6 -> 4"
    # Committed: both leave, the pod is deleted once, and the pod the world keeps is not.
    flight = replace(plan, store=("10.0.0.0", 7000))
    committed = pods(*(members(n, switched(2), role=render.MEMBER) for n in ("p0", "p1")))
    gone = [replace(p, agent=training(1)) for p in members("p2", None, role=render.MEMBER)]
    decision = decide(pods(list(committed.pods.values()), gone),
                      Record(world=old, in_flight=flight), two, NOW)  # fmt: skip
    assert decision.record.world is not None and decision.record.world.members == plan.new.members
    assert leaving(decision.after) == [
        ReleaseMember("p2-0"), ReleaseMember("p2-1"), DeletePod("p2"),
    ]  # fmt: skip
    assert LabelPod("p2", render.STANDBY) in decision.after
    assert decision.status["replicas"] == 2


def test_a_pods_members_are_released_and_told_a_commit_in_one_call() -> None:
    the_job = two_per_pod(2)
    seen_ = _training(2, "p0 p1")
    told = (CommitOn("p0-0", 2), CommitOn("p0-1", 2), CommitOn("p1-0", 2))
    released = (ReleaseMember("p1-0", 3), ReleaseMember("p1-1", 3), DeletePod("p1"))
    decision = Decision(the_job, seen_, NOW, Record(), after=(*told, *released))
    for agent in (FakeAgent, OneAtATime):
        calls: Calls = []
        run = executor(calls, seen_)
        run.clients.update({m: agent(m, calls) for m in run.clients})
        run.run(decision)
        switches = sorted(c[1:] for c in calls if c[0] == "switch")
        releases = sorted(c[1:] for c in calls if c[0] == "release")
        if agent is FakeAgent:  # one call a pod for each command, naming its members
            pair = ("p0-0", "p0-1")
            assert switches == [("p0-0", 2, 0, pair), ("p0-1", 2, 0, pair), ("p1-0", 2, 0, ())]
            pair = ("p1-0", "p1-1")
            assert releases == [("p1-0", 3, pair), ("p1-1", 3, pair)]
        else:  # refused as one call: then one call a member, in the same pass
            assert switches == [("p0-0", 2, 0, ()), ("p0-1", 2, 0, ()), ("p1-0", 2, 0, ())]
            assert releases == [("p1-0", 3, ()), ("p1-1", 3, ())]
        assert kinds(calls)[-1] == "delete p1" and not run.unsent  # deleted once released
    # A commit a pod may take later (unavailable) is told again on the next pass.
    calls = []
    run = executor(calls, seen_, **{"p0-0": ("switch",)})
    run.run(decision)
    assert run.unsent and len([c for c in calls if c[0] == "switch"]) == 3


def test_a_pod_that_ends_loses_its_members_in_one_recovery() -> None:
    the_job = two_per_pod(3)
    old = World.of(1, _layout(the_job, "p0 p1 p2"))
    ended = [replace(p, gone=True) for p in members("p2", None, role=render.MEMBER)]
    seen_now = pods(list(_training(1, "p0 p1").pods.values()), ended)
    decision = decide(seen_now, Record(world=old), the_job, NOW)
    assert isinstance(decision.ask, Begin)
    plan = decision.ask.plan
    assert plan.lost == ("p2-0", "p2-1") and plan.reason.startswith("lost p2-0, p2-1")
    assert sum(isinstance(a, CreatePod) for a in decision.after) == 1  # its replacement
    # A surplus standing-by pod whose members are all spare is deleted whole, once.
    spare = pods(list(_training(1, "p0 p1 p2").pods.values()), members("p3", standby()))
    decision = decide(spare, Record(world=old), the_job, NOW)
    assert leaving(decision.after) == [
        ReleaseMember("p3-0"), ReleaseMember("p3-1"), DeletePod("p3"),
    ]  # fmt: skip


def _layout(the_job: Job, names: str) -> Layout:
    """The tp=2 layout of the members of pods `names`, in pod order."""
    listed = [f"{n}-{k}" for n in names.split() for k in range(2)]
    choice = policy.choose(the_job.model, the_job.spec, len(listed))
    assert choice.used == len(listed), choice.why
    return choice.degrees.layout(the_job.model, listed)


@pytest.mark.parametrize("names", ["p0 p1", "p1 p0"])
def test_a_grow_and_a_recovery_keep_each_tensor_parallel_group_inside_a_pod(names: str) -> None:
    the_job = two_per_pod(3)
    old = World.of(1, _layout(the_job, names))
    grow = pods(list(_training(1, names).pods.values()), members("p2", standby()))
    decision = decide(grow, Record(world=old), the_job, NOW)
    assert isinstance(decision.ask, Begin)
    assert decision.ask.plan.new.describe().startswith("dp=3,tp=2")
    assert inside_pods(decision.ask.plan.new.members)
    # p0 ended: its replacement p3 takes its ranks, and p2 stands by for the third.
    ended = [replace(p, gone=True) for p in members("p0", None, role=render.MEMBER)]
    recovery = pods(list(_training(1, "p1").pods.values()), ended, members("p3", standby()))
    decision = decide(recovery, Record(world=old), the_job, NOW)
    assert isinstance(decision.ask, Begin)
    assert inside_pods(decision.ask.plan.new.members)
    assert set(decision.ask.plan.new.members) == {"p1-0", "p1-1", "p3-0", "p3-1"}


def inside_pods(members: tuple[str, ...]) -> bool:
    owners = [m.rsplit("-", 1)[0] for m in members]
    return all(owners[i] == owners[i + 1] for i in range(0, len(owners), 2))


def test_mirrored_pods_hold_whole_tp_groups_and_no_mirror_pair_shares_a_node() -> None:
    # Pods of 4 on their own nodes, tp=2, each ZeRO shard mirrored on its dp neighbour: the
    # neighbours are put in other pods (a node's loss takes a pod), tp groups stay in pods.
    mirrored = job(2, membersPerPod=4, parallelism={"tp": 2, "zero": 1},
                   faultTolerance={"snapshots": True})  # fmt: skip
    ready = pods(*(members(n, standby(), 4, node=f"node-{n}") for n in ("p0", "p1")))
    decision = decide(ready, Record(), mirrored, NOW)
    assert isinstance(decision.ask, Begin)
    new = decision.ask.plan.new
    assert new.degrees.mirror and inside_pods(new.members)
    layout = new.layout(mirrored.model)
    assert pairs_on_one_node(layout, layout.members, ready.nodes()) == 0
    # Two pods join at once: the grow keeps both properties.
    grown = job(4, membersPerPod=4, parallelism={"tp": 2, "zero": 1},
                faultTolerance={"snapshots": True})  # fmt: skip
    old = World.of(1, layout)
    trained = [replace(p, agent=training(1), role=render.MEMBER) for p in ready.pods.values()]
    joining = [members(n, standby(), 4, node=f"node-{n}") for n in ("p2", "p3")]
    seen_now = pods(trained, *joining)
    decision = decide(seen_now, Record(world=old), grown, NOW)
    assert isinstance(decision.ask, Begin)
    new = decision.ask.plan.new
    assert len(new.members) == 16 and inside_pods(new.members)
    layout = new.layout(grown.model)
    assert pairs_on_one_node(layout, layout.members, seen_now.nodes()) == 0


def test_without_replicas_the_copies_of_a_pods_tp_group_are_in_the_next_pods_stage() -> None:
    # Two pods of 2 on their own nodes, tp=2 inside pods, pp=2, dp=1: each box's copy is on the
    # next stage, the other pod, so a pod's (a node's) loss leaves a copy of every byte.
    the_job = job(2, membersPerPod=2, parallelism={"tp": 2, "pp": 2},
                  faultTolerance={"snapshots": True})  # fmt: skip
    ready = pods(*(members(n, standby(), node=f"node-{n}") for n in ("p0", "p1")))
    decision = decide(ready, Record(), the_job, NOW)
    assert isinstance(decision.ask, Begin)
    new = decision.ask.plan.new
    assert new.describe().startswith("dp=1,tp=2,pp=2") and new.degrees.mirror
    assert inside_pods(new.members)
    layout = new.layout(the_job.model)
    assert mirror_pairs(layout) == [(0, 2), (1, 3)]
    assert pairs_on_one_node(layout, layout.members, ready.nodes()) == 0


def test_a_change_of_layout_fills_each_tensor_parallel_group_from_one_pod() -> None:
    # dp=4 over members listed across pods, switched to tp=2: each tp group is one pod's pair,
    # also when a pod joins (its members on the ranks left) and when rebalancing predicts it.
    the_job = two_per_pod(3)
    model = the_job.model
    old = parse_degrees("dp=4,zero=1").layout(model, ["p0-0", "p1-0", "p0-1", "p1-1"])
    pod_of = {f"p{p}-{k}": f"p{p}" for p in range(3) for k in range(2)}
    for new, joiners in (("dp=2,tp=2,zero=1", []), ("dp=3,tp=2,zero=1", ["p2-0", "p2-1"])):
        members = policy.assign(model, old, parse_degrees(new), list(old.members), joiners, {},
                                pod_of)  # fmt: skip
        assert inside_pods(tuple(members)) and len(members) == parse_degrees(new).world_size
    # Without pods, members are placed by bytes alone.
    plain = policy.assign(model, old, parse_degrees("dp=2,tp=2,zero=1"), list(old.members), [], {})
    assert sorted(plain) == sorted(old.members)


def test_pods_whose_mirror_pairs_share_a_node_are_not_split_but_reported() -> None:
    # Four pods of 2 (tp=2, dp=4, mirrored) on two nodes, neighbours on the ring sharing one:
    # exchanging two members would split tp groups across pods, so none is made, and the job
    # says a node's loss would take both copies of some shards.
    mirrored = job(4, membersPerPod=2, parallelism={"tp": 2, "zero": 1},
                   faultTolerance={"snapshots": True})  # fmt: skip
    names = ("p0", "p1", "p2", "p3")
    on = {"p0": "a", "p1": "a", "p2": "b", "p3": "b"}
    seen_now = pods(*(members(n, training(1), role=render.MEMBER, node=on[n]) for n in names))
    choice = policy.choose(mirrored.model, mirrored.spec, 8)
    old = World.of(1, choice.degrees.layout(mirrored.model, [f"{n}-{k}" for n in names
                                                            for k in range(2)]))  # fmt: skip
    decision = decide(seen_now, Record(world=old), mirrored, NOW)
    assert decision.ask is None
    degraded = next(c for c in decision.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "MirrorPairsOnOneNode")


def test_a_checkpoint_is_asked_of_each_pod_in_one_call() -> None:
    the_job = two_per_pod(2)
    seen_ = _training(1, "p0 p1")
    steady = decide(seen_, Record(world=World.of(1, _layout(the_job, "p0 p1"))), the_job, NOW)
    ask = Checkpoint(tuple(f"{p}-{k}" for p in ("p0", "p1") for k in range(2)), 3, "/ckpt", 9)
    refused = ("checkpoint:FAILED_PRECONDITION",)
    for agent, recorded in (
        (FakeAgent, 3),
        (OneAtATime, 3),
        (partial(FakeAgent, refuse=refused), 0),
    ):
        calls: Calls = []
        run = executor(calls, seen_)
        run.clients.update({m: agent(m, calls) for m in run.clients})
        done = run.run(replace(steady, ask=ask))
        asked = [c for c in calls if c[0] == "checkpoint"]
        assert set(c[1] for c in asked) == set(ask.members), agent
        if agent is FakeAgent:  # one call a pod, naming both its members
            pairs = [("p0-0", "p0-1"), ("p1-0", "p1-1")]
            assert sorted(c[-1] for c in asked) == sorted(2 * pairs)
        if agent is OneAtATime:  # refused as one call: then one call a member
            assert all(c[-1] == () for c in asked)
        assert done.record.checkpoint_asked == recorded, agent


class OneAtATime(FakeAgent):
    """An agent behind a proxy that takes one member a call."""

    def _command(self, method: str, members: Sequence[str], *args: Any) -> None:
        if members:
            raise AgentError(self.member, grpc.StatusCode.INVALID_ARGUMENT, "one required")
        super()._command(method, members, *args)


def test_a_change_tells_every_member_the_pods_its_plan_takes_bytes_inside() -> None:
    the_job = two_per_pod(3)
    old = World.of(1, _layout(the_job, "p0 p1"))
    grow = pods(list(_training(1, "p0 p1").pods.values()), members("p2", standby()))
    decision = decide(grow, Record(world=old), the_job, NOW)
    assert isinstance(decision.ask, Begin)
    expected = tuple((f"{p}-{k}", p) for p in ("p0", "p1", "p2") for k in range(2))
    assert sorted(decision.ask.plan.pods) == sorted(expected)
    # Recorded with the change (so a later pass asks the same), and sent with every Prepare.
    done = hosted(decision, ("10.0.0.1", 7000))
    flight = done.record.in_flight
    assert flight is not None and InFlight.from_dict(flight.to_dict()) == flight
    sent = [a for a in done.after if isinstance(a, Prepare)]
    assert len(sent) == 6 and all(a.pods == flight.pods for a in sent)
    # Each pod takes its members' Prepare in one call, naming them all (its proxy passes it on).
    calls: Calls = []
    executor(calls, grow).run(done)
    prepares = [c for c in calls if c[0] == "prepare"]
    assert sorted(c[1] for c in prepares) == [m for m, _ in sorted(expected)]
    assert sorted(c[5] for c in prepares) == sorted(
        2 * [(f"{p}-0", f"{p}-1") for p in ("p0", "p1", "p2")]
    )
    # A pod that takes one member a call (a proxy of an earlier version) refuses it for good:
    # then each member is sent its own, in the same pass.
    calls.clear()
    one_each = executor(calls, grow)
    one_each.clients.update({m: OneAtATime(m, calls) for m in one_each.clients})
    one_each.run(done)
    prepares = [c for c in calls if c[0] == "prepare"]
    assert sorted(c[1] for c in prepares) == [m for m, _ in sorted(expected)]
    assert all(c[5] == () for c in prepares) and not one_each.unsent
    # Pods of one member share nothing: none is named.
    single = job(3)
    ones = seen(*(pod(f"w{i}", training(1), role=render.MEMBER) for i in range(2)),
                pod("w2", standby()))  # fmt: skip
    world = World.of(1, Layout.create(single.model, ["w0", "w1"], dp=2))
    decision = decide(ones, Record(world=world), single, NOW)
    assert isinstance(decision.ask, Begin) and decision.ask.plan.pods == ()
