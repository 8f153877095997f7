"""The reconcile pass's decision, as a table: what the job's pods and agents say, what the record
holds, and the actions, ask, record and status the pass decides. No cluster, no agent: the
agents' statuses are the proto messages they would send."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from liveshard_operator import render
from liveshard_operator.actions import (
    AbortOn,
    Action,
    Begin,
    Checkpoint,
    CommitOn,
    CreatePod,
    DeletePod,
    Event,
    EventType,
    LabelPod,
    Prepare,
    ReleaseMember,
)
from liveshard_operator.decide import decide
from liveshard_operator.decision import Decision, checkpointed, hosted, not_hosted
from liveshard_operator.inflight import backoff
from liveshard_operator.observation import Job, Observation
from liveshard_operator.publish import HISTORY
from liveshard_operator.world import InFlight, Record, StartFailures, Suspension

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.assign.nodes import pairs_on_one_node
from liveshard_core.errors import InvalidInput
from tests.operator.values import (
    NOW,
    broken,
    checkpoint,
    done,
    failed,
    job,
    pending,
    pod,
    seen,
    standby,
    starting,
    switch,
    training,
    world,
)

COMMITTED, ABORTED = pb.SwitchSummary.COMMITTED, pb.SwitchSummary.ABORTED
UNDECIDED = pb.Pending.UNDECIDED
M, S = render.MEMBER, render.STANDBY


def brief(action: Action) -> str:
    """An action in a word or three, for the tables."""
    match action:
        case CreatePod():
            return "create"
        case DeletePod(pod=name):
            return f"delete {name}"
        case ReleaseMember(member=name, saved=saved):
            return f"release {name}" + (f" saved {saved}" if saved else "")
        case LabelPod(pod=name, role=role):
            return f"label {name} {role}"
        case Prepare(member=name, epoch=epoch):
            return f"prepare {name} {epoch}"
        case AbortOn(member=name, epoch=epoch):
            return f"abort {name} {epoch}"
        case CommitOn(member=name, epoch=epoch):
            return f"commit {name} {epoch}"
        case Event(type=kind, reason=reason):
            return f"{kind.value} {reason}"
    raise AssertionError(action)


def copy_of(agent: pb.AgentStatus | None) -> pb.AgentStatus:
    out = pb.AgentStatus()
    if agent is not None:
        out.CopyFrom(agent)
    return out


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


# ---- the jobs, worlds and reconfigurations of the table ----

J2, J3, J4, J5 = job(2), job(3), job(4), job(5)
CHECKPOINTED = job(3, checkpoint={"path": "/ck/", "everySteps": 5})
W2 = world(J3, ["p0", "p1"], 1)  # a world of 2 in epoch 1
W3 = world(J3, ["p0", "p1", "p2"], 1)
W4 = world(J4, ["p0", "p1", "p2", "p3"], 1)
TRAINING3 = [pod(m, training(1), role=M) for m in ("p0", "p1", "p2")]
# In flight: 2 -> 3 members (p2 joins), epoch 2.
GROW = InFlight(epoch=2, reason="scale 2 -> 3", new=world(J3, ["p0", "p1", "p2"], 2),
                store=("10.0.0.0", 7000), started=NOW - 10, old=W2)  # fmt: skip
# In flight: 3 -> 2 members (p2 leaves), epoch 2.
SHRINK = InFlight(epoch=2, reason="scale 3 -> 2", new=world(J2, ["p0", "p1"], 2),
                  store=("10.0.0.0", 7000), started=NOW - 10, old=W3)  # fmt: skip
# In flight: a rebuild of W2 (every member's world broke, none lost), epoch 2.
REBUILD = InFlight(epoch=2, reason="rebuild", new=world(J2, ["p0", "p1"], 2),
                   store=("10.0.0.0", 7000), started=NOW - 10, old=W2)  # fmt: skip
# In flight: a recovery from the loss of p2, epoch 2.
RECOVERY = replace(SHRINK, reason="lost p2", lost=("p2",))
NO_COPY = pb.SwitchSummary.NO_SURVIVING_COPY
SUSPEND = job(3, checkpoint={"path": "/ck/"}, suspend=True)
RESUME = job(2, checkpoint={"path": "/ck/"})
SAVING = Suspension(1, "/ck/suspend-1-1")  # asked of the members, not saved yet
SAVED = replace(SAVING, step=12)
UNSCHEDULABLE = "Unschedulable: 0/3 nodes are available: 3 node(s) were unschedulable."
OOM = "container agent: OOMKilled, exit code 137"
REFUSED = "agent: LIVESHARD_CONFIG: training: /data/x: no such file or folder"
LAST = f"p9: {OOM}"
OLD = NOW - 1000  # scheduled long before the failures of the table
# p0 stands by; p1's agent was killed for the memory it took (a job of 2 that needs 2 to start).
J2OF2 = job(2, minReplicas=2)
P1_OOM = seen(pod("p0", standby(), since=OLD), pod("p1", None, gone=True, failure=OOM))
# p0 and p1 train in W2; p2 failed to start.
W2_P2_OOM = seen(*(pod(m, training(1), role=M, since=OLD) for m in ("p0", "p1")),
                 pod("p2", None, gone=True, failure=OOM))  # fmt: skip
# p0's and p1's world broke; p2 answers nothing.
P2_SILENT = seen(
    pod("p0", broken(1), role=M), pod("p1", broken(1), role=M), pod("p2", None, role=M)
)


@dataclass(frozen=True)
class Case:
    job: Job
    seen: Observation
    record: Record
    phase: str
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    ask: str | None = None  # "begin <epoch> on <host>: <members> <reason>" or "checkpoint ..."
    message: str = ""  # a fragment of the Ready condition's message
    degraded: str = ""  # the Degraded condition's reason, when it is true
    changed: dict[str, Any] = field(default_factory=dict)  # the record's fields that change


def asked(decision: Decision) -> str | None:
    match decision.ask:
        case Begin(host=host, plan=plan):
            lost = f" lost={','.join(plan.lost)}" if plan.lost else ""
            old = "" if plan.old is None else f" from epoch {plan.old.epoch}"
            members = ",".join(plan.new.members)
            return f"begin {plan.epoch} on {host}: {members}{old}{lost} {plan.reason}"
        case Checkpoint(members=members, number=number, path=path, at_step=at_step):
            return f"checkpoint {number} at {at_step} in {path} on {','.join(members)}"
    return None


CASES: dict[str, Case] = {
    "no world, too few ready pods: create the rest and wait": Case(
        J4, seen(pod("p0", standby()), pod("p1", starting())), Record(), "Pending",
        after=["create", "create"],
        message="waiting for ready pods: 1 of 4 ready, 1 pre-warming (1 to start)",
    ),
    "no world, minReplicas ready, the rest unschedulable: start with what is there": Case(
        job(4, minReplicas=2),
        seen(pod("p0", standby()), pod("p1", standby()),
             *(pod(f"p{i}", None, unschedulable=UNSCHEDULABLE) for i in (2, 3))),
        Record(), "Pending", ask="begin 0 on p0: p0,p1 start with 2 of 4 pods: ",
        degraded="Unschedulable",
    ),
    "no world, fewer than minReplicas ready: wait, saying why the rest are missing": Case(
        job(4, minReplicas=2),
        seen(pod("p0", standby()), *(pod(f"p{i}", None, unschedulable=UNSCHEDULABLE)
                                     for i in (1, 2, 3))),
        Record(), "Pending", message="1 of 4 ready (2 to start)", degraded="Unschedulable",
    ),
    "no world, minReplicas ready, the rest pre-warming: wait to start with all": Case(
        job(4, minReplicas=2),
        seen(pod("p0", standby()), pod("p1", standby()), pod("p2", starting()),
             pod("p3", None)),
        Record(), "Pending", message="2 of 4 ready, 2 pre-warming",
    ),
    "no world, a pod scheduled past the pending timeout: start without it": Case(
        job(4, minReplicas=2, scheduling={"pendingTimeoutSeconds": 60}),
        seen(*(pod(f"p{i}", standby()) for i in range(3)), pod("p3", starting(), since=NOW - 61)),
        Record(), "Pending", ask="begin 0 on p0: p0,p1,p2 start with 3 of 4 pods: ",
        degraded="PendingTimeout",
    ),
    "enough ready pods: the first world, hosted on its first member": Case(
        J4, seen(*(pod(f"p{i}", standby()) for i in range(4))), Record(), "Pending",
        ask="begin 0 on p0: p0,p1,p2,p3 start with",
    ),
    "the first world from the spec's checkpoint": Case(
        job(2, checkpoint={"restoreFrom": "/ck/step-9"}),
        seen(pod("p0", standby()), pod("p1", standby())), Record(), "Pending",
        ask="begin 0 on p0: p0,p1 start with",
    ),
    "no world, backing off after an abort": Case(
        J2, seen(pod("p0", standby()), pod("p1", standby())),
        Record(last_epoch=0, attempts=1, retry_after=NOW + 3), "Pending",
    ),
    "a lost member: recover without it, replace its pod": Case(
        J3, seen(*TRAINING3[:2], pod("p2", None, gone=True)), Record(world=W3), "Running",
        after=["create"], ask="begin 2 on p0: p0,p1 from epoch 1 lost=p2 lost p2",
    ),
    "a member's pod deleted: recover at once, even backing off": Case(
        J3, seen(*TRAINING3[:2]), Record(world=W3, attempts=2, retry_after=NOW + 30), "Running",
        after=["create"], ask="begin 2 on p0: p0,p1 from epoch 1 lost=p2 lost p2",
    ),
    "a leaving member: move its state out": Case(
        J3, seen(*TRAINING3[:2], pod("p2", training(1), role=M, leaving=True)), Record(world=W3),
        "Running", after=["create"], ask="begin 2 on p0: p0,p1 from epoch 1 evicting p2",
    ),
    "scale up: a standby pod joins": Case(
        J3, seen(*TRAINING3[:2], pod("p2", standby(), role=S)), Record(world=W2), "Running",
        ask="begin 2 on p0: p0,p2,p1 from epoch 1 scale 2 -> 3",  # assigned to move least
    ),
    "scale up: wait for the new pod to pre-warm": Case(
        J3, seen(*TRAINING3[:2], pod("p2", starting())), Record(world=W2), "Running",
        after=["label p2 standby"], message="pre-warming 1 pod(s)",
    ),
    "scale up: a pod the scheduler cannot place holds up no growth": Case(
        J4, seen(*TRAINING3[:2], pod("p2", standby(), role=S),
                 pod("p3", None, role=S, unschedulable=UNSCHEDULABLE)),
        Record(world=W2), "Running", ask="begin 2 on p0: p0,p2,p1 from epoch 1 scale 2 -> 3",
        degraded="Unschedulable",
    ),
    "scale up: pods that land together join together": Case(
        J4, seen(*TRAINING3[:2], pod("p2", standby(), role=S), pod("p3", starting())),
        Record(world=W2), "Running", after=["label p3 standby"], message="pre-warming 1 pod(s)",
    ),
    "a pod short and nothing to change: train on, saying why": Case(
        J4, seen(*TRAINING3, pod("p3", None, unschedulable=UNSCHEDULABLE)), Record(world=W3),
        "Running", after=["label p3 standby"], message="3 members training",
        degraded="Unschedulable",
    ),
    "scale up: backing off after an abort": Case(
        J3, seen(*TRAINING3[:2], pod("p2", standby(), role=S)),
        Record(world=W2, last_epoch=1, attempts=1, retry_after=NOW + 3), "Running",
    ),
    "scale down": Case(
        J2, seen(*(pod(f"p{i}", training(1), role=M) for i in range(4))), Record(world=W4),
        "Running", ask="begin 2 on p0: p0,p2 from epoch 1 scale 4 -> 2",  # assigned to move least
    ),
    "nothing to do: a pod no layout uses stands by": Case(
        J5, seen(*(pod(f"p{i}", training(1), role=M) for i in range(4)), pod("p4", standby())),
        Record(world=W4), "Running", after=["label p4 standby"],
        message="1 pod(s) stand by as hot spares: no layout of tiny uses 5 members",
        degraded="HotSpares",
    ),
    "nothing to do": Case(
        J3, seen(*TRAINING3), Record(world=W3), "Running", message="3 members training",
    ),
    "a checkpoint is due (step 10, every 5 steps)": Case(
        CHECKPOINTED, seen(*TRAINING3), Record(world=W3), "Running",
        ask="checkpoint 3 at 15 in /ck/step-15 on p0,p1,p2",
    ),
    "the checkpoint due was asked for already": Case(
        CHECKPOINTED, seen(*TRAINING3), Record(world=W3, checkpoint_asked=3), "Running",
    ),
    "the job trained its last step: release and delete every pod": Case(
        J3, seen(pod("p0", done(1), role=M), *TRAINING3[1:]), Record(world=W3), "Succeeded",
        before=["release p0", "delete p0", "release p1", "delete p1", "release p2", "delete p2"],
        message="3 members training",
    ),
    # ---- suspension ----
    "suspend: every member trains, ask for a checkpoint at their step": Case(
        SUSPEND, seen(*TRAINING3), Record(world=W3), "Running",
        ask="checkpoint 1 at 10 in /ck/suspend-1-1 on p0,p1,p2", message="suspending",
        changed={"suspended": SAVING},
    ),
    "suspend again after a resume: a new checkpoint": Case(
        SUSPEND, seen(*TRAINING3), Record(world=W3, checkpoint_asked=1, suspended=SAVED),
        "Running", ask="checkpoint 2 at 10 in /ck/suspend-1-2 on p0,p1,p2",
        changed={"suspended": Suspension(2, "/ck/suspend-1-2")},
    ),
    "suspend: asked, not saved yet: wait": Case(
        SUSPEND, seen(*TRAINING3), Record(world=W3, checkpoint_asked=1, suspended=SAVING),
        "Running", message="suspending",
    ),
    "suspend: its number taken by a periodic checkpoint saved meanwhile: the next number": Case(
        SUSPEND,
        seen(*(pod(m, training(1, last_checkpoint=checkpoint(1, 9, "/ck/step-9")), role=M)
               for m in ("p0", "p1", "p2"))),
        Record(world=W3, checkpoint_asked=0, suspended=SAVING), "Running",
        ask="checkpoint 2 at 10 in /ck/suspend-1-2 on p0,p1,p2", message="suspending",
        changed={"suspended": Suspension(2, "/ck/suspend-1-2")},
    ),
    "suspend: saved by every member: leave the world, release every pod": Case(
        SUSPEND,
        seen(*(pod(m, training(1, step=12, last_checkpoint=checkpoint(1, 12, "/ck/suspend-1-1")),
                   role=M) for m in ("p0", "p1", "p2"))),
        Record(world=W3, checkpoint_asked=1, suspended=SAVING), "Suspended",
        after=["release p2 saved 1", "delete p2", "release p1 saved 1", "delete p1",
               "release p0 saved 1", "delete p0", "Normal Suspended"],
        changed={"world": None, "suspended": SAVED},
    ),
    "suspend: a member lost: recover first": Case(
        SUSPEND, seen(*TRAINING3[:2], pod("p2", None, gone=True)), Record(world=W3), "Running",
        after=["create"], ask="begin 2 on p0: p0,p1 from epoch 1 lost=p2 lost p2",
    ),
    "suspended: no pod is kept": Case(
        SUSPEND, seen(pod("p3", standby())), Record(last_epoch=1, suspended=SAVED), "Suspended",
        after=["release p3 saved 1", "delete p3"],
    ),
    "created suspended: no pod is started": Case(SUSPEND, seen(), Record(), "Suspended"),
    "resume: a first world from the suspension's checkpoint, in the layout the pods allow": Case(
        RESUME, seen(pod("p3", standby()), pod("p4", standby())),
        Record(last_epoch=1, suspended=SAVED), "Pending",
        ask="begin 2 on p3: p3,p4 resume from /ck/suspend-1-1 (step 12); start with",
    ),
    "resumed: the suspension is owed no more": Case(
        job(3, checkpoint={"path": "/ck/"}), seen(*TRAINING3),
        Record(world=W3, last_epoch=2, suspended=SAVED), "Running", changed={"suspended": None},
    ),
    # ---- silent members ----
    "a member answers nothing while another's world broke: the clock starts": Case(
        J3, P2_SILENT, Record(world=W3), "Running", changed={"silent": {"p2": NOW}},
    ),
    "silent for the op deadline only: a collective it entered late may still be failing": Case(
        J3, P2_SILENT, Record(world=W3, silent={"p2": NOW - 10}), "Running",
    ),
    "silent for twice the op deadline: its pod is deleted and it counts as lost": Case(
        J3, P2_SILENT, Record(world=W3, silent={"p2": NOW - 20}), "Running", after=["delete p2"],
        ask="begin 2 on p0: p0,p1 from epoch 1 lost=p2 lost p2",
    ),
    "still training while its world broke: hung, silent for twice the op deadline": Case(
        J3, seen(pod("p0", broken(1), role=M), pod("p1", broken(1), role=M),
                 pod("p2", training(1), role=M)),
        Record(world=W3, silent={"p2": NOW - 20}), "Running", after=["delete p2"],
        ask="begin 2 on p0: p0,p1 from epoch 1 lost=p2 lost p2",
    ),
    "every member's world broke, none is lost (a partition): rebuild in the same layout": Case(
        J3, seen(*[pod(m, broken(1), role=M) for m in ("p0", "p1", "p2")]),
        Record(world=W3), "Running",
        ask="begin 2 on p0: p0,p1,p2 from epoch 1 rebuild: every member's world broke, none is "
            "lost",
    ),
    "a member that does not answer while nothing broke is not silent": Case(
        J3, seen(pod("p0", training(1), role=M), pod("p1", training(1), role=M),
                 pod("p2", None, role=M)),
        Record(world=W3, silent={"p2": NOW - 60}), "Running", changed={"silent": {}},
    ),
    # ---- worker pods that fail before they become members ----
    "a pod failed to start: counted, reported, no new pod for 10 s": Case(
        J2OF2, P1_OOM, Record(), "Pending", after=["Warning WorkerCrashing"],
        message="waiting for ready pods: 1 of 2 ready", degraded="WorkerCrashing",
        changed={"start_failures": StartFailures(1, f"p1: {OOM}", NOW, NOW + 10, ("p1",))},
    ),
    "backing off: the failed pod is kept (its logs) and not counted again": Case(
        J2OF2, P1_OOM, Record(start_failures=StartFailures(1, f"p1: {OOM}", NOW - 5, NOW + 5,
                                                           ("p1",))),
        "Pending", degraded="WorkerCrashing",
    ),
    "backoff over: the failed pod is deleted and replaced": Case(
        J2OF2, P1_OOM, Record(start_failures=StartFailures(1, f"p1: {OOM}", NOW - 10, NOW,
                                                           ("p1",))),
        "Pending", after=["delete p1", "create"], degraded="WorkerCrashing",
    ),
    "the next failure in a row backs off twice as long": Case(
        J2OF2, seen(pod("p0", standby(), since=OLD), pod("p2", None, gone=True, failure=OOM)),
        Record(start_failures=StartFailures(2, LAST, NOW - 30, NOW - 10, ("p1",))), "Pending",
        after=["Warning WorkerCrashing"], degraded="WorkerCrashing",
        changed={"start_failures": StartFailures(3, f"p2: {OOM}", NOW, NOW + 40, ("p2",))},
    ),
    "a pod that crash-loops is deleted when it is replaced": Case(
        J2OF2, seen(pod("p0", standby(), since=OLD),
                    pod("p1", None, failure="container agent: crash-looping, last Error, "
                                            "exit code 2")),
        Record(start_failures=StartFailures(1, LAST, NOW - 10, NOW, ("p1",))), "Pending",
        after=["delete p1", "create"], degraded="WorkerCrashing",
    ),
    "an agent that refuses its configuration counts as a failed start": Case(
        J2OF2, seen(pod("p0", standby(), since=OLD), pod("p1", failed(REFUSED[7:]))), Record(),
        "Pending",
        after=["Warning WorkerCrashing"], degraded="WorkerCrashing",
        changed={"start_failures": StartFailures(1, f"p1: {REFUSED}", NOW, NOW + 10, ("p1",))},
    ),
    "maxStartFailures in a row and no world: Failed, the pods that run released": Case(
        job(2, minReplicas=2, scheduling={"maxStartFailures": 3}), P1_OOM,
        Record(start_failures=StartFailures(2, LAST, NOW - 30, NOW - 10)), "Failed",
        before=["release p0", "delete p0"],
        after=["Warning WorkerCrashing", "Warning WorkersCrashing"], degraded="WorkerCrashing",
        changed={"start_failures": StartFailures(3, f"p1: {OOM}", NOW, NOW + 40, ("p1",))},
    ),
    "maxStartFailures in a row with a world: train on with the members, Degraded": Case(
        J3, W2_P2_OOM, Record(world=W2, start_failures=StartFailures(4, LAST, NOW - 90, NOW - 10)),
        "Running", after=["Warning WorkerCrashing"], degraded="WorkerCrashing",
        changed={"start_failures": StartFailures(5, f"p2: {OOM}", NOW, NOW + 160, ("p2",))},
    ),
    "a pod scheduled after the last failure starts fine: the row ends, it joins": Case(
        J3, seen(pod("p0", training(1), role=M, since=OLD),
                 pod("p1", training(1), role=M, since=OLD), pod("p2", standby(), role=S)),
        Record(world=W2, start_failures=StartFailures(3, LAST, NOW - 60, NOW - 20)), "Running",
        ask="begin 2 on p0: p0,p2,p1 from epoch 1 scale 2 -> 3",
        changed={"start_failures": StartFailures()},
    ),
    "a member's pod that died is the recovery's, not a failed start": Case(
        J3, seen(*TRAINING3[:2], pod("p2", None, role=M, gone=True, failure=OOM)),
        Record(world=W3), "Running", after=["create"],
        ask="begin 2 on p0: p0,p1 from epoch 1 lost=p2 lost p2",
    ),
    # ---- a reconfiguration in flight ----
    "in flight: every new member trains in its epoch, commit": Case(
        J3, seen(pod("p0", training(2, last_switch=switch(2, COMMITTED, pause_seconds=0.5,
                                                           network_bytes=1000)), role=M),
                 pod("p1", training(2), role=M), pod("p2", training(2), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Running",
        after=["Normal Reconfigured", "label p2 member"],
        changed={"world": GROW.new, "in_flight": None},
    ),
    "in flight: every new member trains in its epoch, none has its account yet: wait": Case(
        J2, seen(pod("p0", training(2), role=M), pod("p1", training(2), role=M),
                 pod("p2", training(1), role=M)),
        Record(world=W3, in_flight=SHRINK, last_epoch=2), "Reconfiguring",
        message="epoch 2: every member switched; waiting for an account",
    ),
    "in flight: a restore trains in its epoch: commit, no switch to account for": Case(
        J2, seen(pod("p0", training(2, last_switch=switch(1, ABORTED, NO_COPY)), role=M),
                 pod("p1", training(2), role=M)),
        Record(in_flight=replace(SHRINK, reason="restore from /ck/step-3", old=None),
               last_epoch=2), "Running",
        after=["Normal Reconfigured"],
        changed={"world": SHRINK.new, "in_flight": None},
    ),
    "in flight: commit a scale down, release and delete who left": Case(
        J2, seen(pod("p0", training(2), role=M),
                 pod("p1", training(2, last_switch=switch(2, COMMITTED, pause_seconds=0.25)),
                     role=M),
                 pod("p2", training(1), role=M)),
        Record(world=W3, in_flight=SHRINK, last_epoch=2), "Running",
        after=["Normal Reconfigured", "label p2 standby", "release p2", "delete p2"],
        changed={"world": SHRINK.new, "in_flight": None},
    ),
    "in flight: a member died after the commit was decided: commit, it is recovered next": Case(
        J3, seen(pod("p0", training(2, last_switch=switch(2, COMMITTED)), role=M),
                 pod("p2", training(2), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Running",
        after=["Normal Reconfigured", "label p2 member"],
        changed={"world": GROW.new, "in_flight": None},
    ),
    "in flight: a member died after the commit, another has not switched yet: wait": Case(
        J3, seen(pod("p0", training(2, last_switch=switch(2, COMMITTED)), role=M),
                 pod("p2", standby(pending=pending(2)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Reconfiguring",
        message="epoch 2: 1/2 members switched; 1 vanished after the decision",
    ),
    "in flight: wait, preparing who has not taken it": Case(
        J3, seen(pod("p0", training(1, pending=pending(2)), role=M),
                 pod("p1", training(1), role=M), pod("p2", standby())),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Reconfiguring",
        after=["prepare p1 2", "prepare p2 2"],
        message="epoch 2: 0/3 members switched",
    ),
    "in flight: an agent aborted, abort everywhere and back off": Case(
        J3, seen(pod("p0", training(1, last_switch=switch(2, ABORTED, reason="vote no")), role=M),
                 pod("p1", training(1, pending=pending(2)), role=M),
                 pod("p2", standby(), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Running",
        before=["abort p1 2"], after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1)},
        degraded="ReconfigurationAborted",
    ),
    "in flight: a member failed to prepare": Case(
        J3, seen(pod("p0", training(1, pending=pending(2)), role=M),
                 pod("p1", training(1, pending=pending(2)), role=M),
                 pod("p2", standby(pending=pending(2, pb.Pending.FAILED, "no memory")))),
        Record(world=W2, in_flight=GROW, last_epoch=2, attempts=1), "Running",
        before=["abort p0 2", "abort p1 2", "abort p2 2"], after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 2, "retry_after": NOW + backoff(2)},
        degraded="ReconfigurationAborted",
    ),
    "in flight: a member vanished": Case(
        J3, seen(pod("p0", training(1, pending=pending(2)), role=M),
                 pod("p1", training(1, pending=pending(2)), role=M)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Running",
        before=["abort p0 2", "abort p1 2"], after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1)},
        degraded="ReconfigurationAborted",
    ),
    "in flight: a member's world broke before it took the change: it never will, abort": Case(
        J3, seen(pod("p0", broken(1), role=M), pod("p1", training(1, pending=pending(2)), role=M),
                 pod("p2", standby(pending=pending(2)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Running",
        before=["abort p1 2", "abort p2 2"], after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1)},
        degraded="ReconfigurationAborted",
    ),
    "in flight: a rebuild is what broken members take: wait, preparing them": Case(
        J3, seen(pod("p0", broken(1, pending=pending(2)), role=M), pod("p1", broken(1), role=M)),
        Record(world=W2, in_flight=REBUILD, last_epoch=2), "Reconfiguring",
        after=["prepare p1 2"], message="epoch 2: 0/2 members switched",
    ),
    "in flight: a member broke in the change's epoch: it committed, no abort": Case(
        J3, seen(pod("p0", broken(2), role=M), pod("p1", training(2), role=M),
                 pod("p2", standby(pending=pending(2)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Reconfiguring",
        message="epoch 2: 1/3 members switched",
    ),
    "in flight: overdue (every deadline and a minute passed)": Case(
        J3, seen(pod("p0", training(1, pending=pending(2)), role=M),
                 pod("p1", training(1, pending=pending(2)), role=M),
                 pod("p2", standby(pending=pending(2)), role=S)),
        Record(world=W2, in_flight=replace(GROW, started=NOW - 450 - 61), last_epoch=2),
        "Running", before=["abort p0 2", "abort p1 2", "abort p2 2"],
        after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1)},
        degraded="ReconfigurationAborted",
    ),
    "in flight: the store's host died; p1 read the commit, p2 could not: p2 is told": Case(
        J3, seen(pod("p0", None, gone=True, role=M), pod("p1", training(2), role=M),
                 pod("p2", standby(pending=pending(2, UNDECIDED)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Reconfiguring",
        after=["commit p2 2"], message="telling p2 it committed",
    ),
    "in flight: p2 could not read the decision, p1 is still switching: wait for p1": Case(
        J3, seen(pod("p0", None, gone=True, role=M),
                 pod("p1", training(1, pending=pending(2)), role=M),
                 pod("p2", standby(pending=pending(2, UNDECIDED)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Reconfiguring",
        message="p2 could not read the decision; waiting for p1 to end the switch",
    ),
    "in flight: no member read the decision: every undecided one aborts": Case(
        J3, seen(pod("p0", training(1, pending=pending(2, UNDECIDED)), role=M),
                 pod("p1", training(1, pending=pending(2, UNDECIDED)), role=M),
                 pod("p2", standby(pending=pending(2, UNDECIDED)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Running",
        before=["abort p0 2", "abort p1 2", "abort p2 2"],
        after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1)},
        degraded="ReconfigurationAborted",
    ),
    "in flight: some members committed, some aborted (a protocol breach): Failed": Case(
        J3, seen(pod("p0", training(2), role=M),
                 pod("p1", training(1, last_switch=switch(2, ABORTED)), role=M),
                 pod("p2", standby(pending=pending(2)), role=S)),
        Record(world=W2, in_flight=GROW, last_epoch=2), "Failed",
        after=["Warning SplitReconfiguration"],
    ),
    "in flight: a recovery that cannot succeed owes a restore": Case(
        J2, seen(pod("p0", broken(1, last_switch=switch(2, ABORTED, NO_COPY, "no surviving copy"))),
                 pod("p1", broken(1, pending=pending(2)))),
        Record(world=W3, in_flight=RECOVERY, last_epoch=2), "Running",
        before=["abort p1 2"], after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1),
                 "restore": "the recovery from the loss of p2 aborted by p0: no surviving copy"},
        degraded="ReconfigurationAborted",
    ),
    "in flight: a recovery that may succeed on retry owes no restore": Case(
        J2, seen(pod("p0", broken(1, last_switch=switch(2, ABORTED, pb.SwitchSummary.PEER_FAILED))),
                 pod("p1", broken(1))),
        Record(world=W3, in_flight=RECOVERY, last_epoch=2), "Running",
        after=["Warning ReconfigurationAborted"],
        changed={"in_flight": None, "attempts": 1, "retry_after": NOW + backoff(1)},
        degraded="ReconfigurationAborted",
    ),
    # ---- a restore owed ----
    "a restore owed: a new first world from the last checkpoint": Case(
        J3, seen(pod("p0", broken(1, last_checkpoint=checkpoint(2, 6, "/ck/step-6")), role=M),
                 pod("p1", broken(1, last_checkpoint=checkpoint(1, 3, "/ck/step-3")), role=M),
                 pod("p3", standby())),
        Record(world=W3, last_epoch=2, restore="the recovery aborted"), "Running",
        ask="begin 3 on p0: p0,p1,p3 restore from /ck/step-6 (step 6): the recovery aborted",
    ),
    "a restore owed without a checkpoint: Failed": Case(
        J3, seen(pod("p0", broken(1), role=M), pod("p1", broken(1), role=M)),
        Record(world=W3, last_epoch=2, restore="the recovery aborted"), "Failed",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide(case: Case) -> None:
    decision = decide(case.seen, case.record, case.job, NOW)
    assert [brief(a) for a in decision.before] == case.before
    assert [brief(a) for a in decision.after] == case.after
    ask = asked(decision)
    assert (ask is None) == (case.ask is None), ask
    assert ask is None or case.ask is None or ask.startswith(case.ask), ask
    assert decision.record == replace(case.record, **case.changed)
    status = decision.status
    assert status["phase"] == case.phase
    assert case.message in condition(status, "Ready")["message"]
    degraded = condition(status, "Degraded")
    assert (degraded["reason"] if degraded["status"] == "True" else "") == case.degraded
    assert status["reconfiguration"] == decision.record.to_dict()


def test_the_commit_reports_the_pause_of_a_member_that_gave_its_account() -> None:
    case = CASES["in flight: commit a scale down, release and delete who left"]
    last = decide(case.seen, case.record, case.job, NOW).status["lastReconfiguration"]
    assert last["result"] == "committed" and last["pauseSeconds"] == 0.25
    # A restore's record takes nothing from an account of an earlier switch.
    case = CASES["in flight: a restore trains in its epoch: commit, no switch to account for"]
    last = decide(case.seen, case.record, case.job, NOW).status["lastReconfiguration"]
    assert last["message"] == "epoch 2: committed" and last["bytesMoved"] == 0, last


def test_a_pass_reads_no_clock_and_decides_the_same_twice() -> None:
    case = CASES["a lost member: recover without it, replace its pod"]
    first = decide(case.seen, case.record, case.job, NOW)
    assert decide(case.seen, case.record, case.job, NOW) == first


def test_the_first_world_is_recorded_in_flight_once_its_store_is_hosted() -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    decision = decide(pods, Record(), J4, NOW)
    assert isinstance(decision.ask, Begin) and decision.ask.plan.store == ("", 0)
    begun = hosted(decision, ("10.0.0.0", 7000))
    assert begun.ask is None
    plan = begun.record.in_flight
    assert plan is not None and plan.store == ("10.0.0.0", 7000) and plan.old is None
    assert (plan.epoch, plan.started, begun.record.last_epoch) == (0, NOW, 0)
    assert plan.new.members == ("p0", "p1", "p2", "p3") and plan.new.describe().startswith("dp=4")
    # The Prepare calls come after the write that records the reconfiguration (`after`).
    assert [brief(a) for a in begun.after] == [
        "Normal Reconfiguring", "prepare p0 0", "prepare p1 0", "prepare p2 0", "prepare p3 0",
    ]  # fmt: skip
    prepare = begun.after[1]
    assert isinstance(prepare, Prepare)
    assert prepare.store == ("10.0.0.0", 7000) and prepare.old is None
    assert prepare.to == plan.new.layout(J4.model) and prepare.budget == 64 << 20
    status = begun.status
    assert status["phase"] == "Reconfiguring"
    assert status["reconfiguration"]["inFlight"]["store"] == {"host": "10.0.0.0", "port": 7000}
    assert condition(status, "Reconfiguring")["status"] == "True"


def test_no_store_no_reconfiguration() -> None:
    pods = seen(*(pod(f"p{i}", standby()) for i in range(4)))
    decision = not_hosted(decide(pods, Record(), J4, NOW), "agent p0: UNAVAILABLE: gone")
    assert decision.ask is None and decision.after == () and decision.record == Record()
    status = decision.status
    assert status["phase"] == "Pending" and status["reconfiguration"]["inFlight"] is None
    ready = condition(status, "Ready")["message"]
    assert ready == "epoch 0: hosting the store on p0: agent p0: UNAVAILABLE: gone"


def test_the_first_world_restores_the_checkpoint_the_spec_names() -> None:
    case = CASES["the first world from the spec's checkpoint"]
    decision = decide(case.seen, case.record, case.job, NOW)
    assert isinstance(decision.ask, Begin) and decision.ask.plan.restore == "/ck/step-9"
    assert decision.ask.plan.reason.endswith(", from /ck/step-9")
    prepares = hosted(decision, ("10.0.0.0", 7000)).after[1:]
    assert [p.restore_from for p in prepares if isinstance(p, Prepare)] == ["/ck/step-9"] * 2


def test_a_restore_is_owed_until_it_begins() -> None:
    case = CASES["a restore owed: a new first world from the last checkpoint"]
    decision = decide(case.seen, case.record, case.job, NOW)
    assert isinstance(decision.ask, Begin) and decision.ask.plan.restore == "/ck/step-6"
    assert hosted(decision, ("10.0.0.0", 7000)).record.restore == ""
    assert not_hosted(decision, "refused").record.restore == "the recovery aborted"


def test_a_recovery_is_hosted_by_a_member_that_stays() -> None:
    case = CASES["a lost member: recover without it, replace its pod"]
    decision = hosted(decide(case.seen, case.record, case.job, NOW), ("10.0.0.0", 7000))
    plan = decision.record.in_flight
    assert plan is not None and plan.lost == ("p2",) and plan.old == W3
    prepares = [a for a in decision.after if isinstance(a, Prepare)]
    assert [p.member for p in prepares] == ["p0", "p1"]
    assert all(p.lost == ("p2",) and p.old == W3.layout(J3.model) for p in prepares)


@pytest.mark.parametrize("taken", [True, False])
def test_a_checkpoint_is_recorded_once_every_member_took_it(taken: bool) -> None:
    decision = decide(seen(*TRAINING3), Record(world=W3), CHECKPOINTED, NOW)
    assert decision.ask == Checkpoint(("p0", "p1", "p2"), 3, "/ck/step-15", 15)
    after = checkpointed(decision, taken)
    assert after.ask is None
    assert after.record.checkpoint_asked == (3 if taken else 0)


@pytest.mark.parametrize(
    ("every", "step", "asked", "expected"),
    [
        (0, 10, 0, (1, 100, "/hf")),  # export only: one checkpoint of the last step
        (0, 10, 1, None),  # already asked
        (5, 10, 0, (3, 15, "")),  # periodic, not yet the last
        (40, 90, 0, (3, 100, "/hf")),  # the next period is past the end: the last step
        (50, 60, 0, (2, 100, "/hf")),  # a period that ends at the last step is exported
    ],
)
def test_the_last_step_is_checkpointed_and_exported(
    every: int, step: int, asked: int, expected: tuple[int, int, str] | None
) -> None:
    the_job = job(3, checkpoint={"path": "/ck", "everySteps": every, "exportTo": "/hf"})
    pods = seen(*(pod(m, training(1, step=step), role=M) for m in ("p0", "p1", "p2")))
    decision = decide(pods, Record(world=W3, checkpoint_asked=asked), the_job, NOW)
    if expected is None:
        assert decision.ask is None
        return
    number, at_step, export_to = expected
    path = f"/ck/step-{at_step}"
    assert decision.ask == Checkpoint(("p0", "p1", "p2"), number, path, at_step, export_to)


@pytest.mark.parametrize(
    ("saved", "message", "exported"),
    [
        (pb.CheckpointSummary(number=1, step=100, path="/ck/step-100", exported_to="/hf"),
         "exported step 100 to /hf", "/hf"),
        (pb.CheckpointSummary(number=1, step=100, path="/ck/step-100",
                              export_error="InvalidInput: --out /hf: exists"),
         "not exported to /hf: InvalidInput: --out /hf: exists", None),
    ],
)  # fmt: skip
def test_a_finished_job_says_where_it_was_exported(
    saved: pb.CheckpointSummary, message: str, exported: str | None
) -> None:
    the_job = job(3, checkpoint={"path": "/ck", "exportTo": "/hf"})
    speaker = done(1)
    speaker.last_checkpoint.CopyFrom(saved)
    pods = seen(pod("p0", speaker, role=M), *TRAINING3[1:])
    status = decide(pods, Record(world=W3), the_job, NOW).status
    assert status["phase"] == "Succeeded" and status.get("exportedTo") == exported
    assert condition(status, "Succeeded")["message"] == f"trained 100 steps; {message}"


def test_a_job_done_before_its_last_step_was_checkpointed_asks_for_it_then() -> None:
    """Its members keep their state when done: once all are, they are asked for the last step's
    checkpoint (once), and the job stays Running until it is exported; a member gone means no
    export, and the job ends saying so."""
    the_job = job(3, checkpoint={"path": "/ck", "everySteps": 40, "exportTo": "/hf"})
    saved = checkpoint(2, 80, "/ck/step-80")
    finished = [pod(m, done(1), role=M) for m in ("p0", "p1", "p2")]
    for member in finished:
        assert member.agent is not None
        member.agent.last_checkpoint.CopyFrom(saved)
    decision = decide(seen(*finished), Record(world=W3, checkpoint_asked=2), the_job, NOW)
    assert decision.ask == Checkpoint(("p0", "p1", "p2"), 3, "/ck/step-100", 100, "/hf")
    assert decision.status["phase"] == "Running" and decision.before == ()
    assert condition(decision.status, "Ready")["message"] == "exporting step 100 to /hf"
    asked = decide(seen(*finished), Record(world=W3, checkpoint_asked=3), the_job, NOW)
    assert asked.ask is None and asked.status["phase"] == "Running"
    last = pod("p2", training(1, step=99), role=M)
    waiting = decide(seen(*finished[:2], last), Record(world=W3, checkpoint_asked=2), the_job, NOW)
    assert waiting.ask is None and waiting.status["phase"] == "Running"
    gone = decide(seen(*finished[:2]), Record(world=W3, checkpoint_asked=2), the_job, NOW)
    assert gone.ask is None and gone.status["phase"] == "Succeeded"
    message = condition(gone.status, "Succeeded")["message"]
    assert message == "trained 100 steps; not exported to /hf: p2 is gone"


def test_exporting_needs_a_checkpoint_path() -> None:
    with pytest.raises(InvalidInput, match=r"exportTo needs spec\.checkpoint\.path"):
        job(3, checkpoint={"exportTo": "/hf"})


def test_a_commit_asks_again_for_a_checkpoint_its_joiners_never_had() -> None:
    case = CASES["in flight: every new member trains in its epoch, commit"]
    record = replace(case.record, checkpoint_asked=4)
    pods = []
    for member in case.seen.pods.values():
        agent = copy_of(member.agent)
        agent.last_checkpoint.CopyFrom(checkpoint(2, 10, "/ck/step-10"))
        pods.append(replace(member, agent=agent))
    decision = decide(seen(*pods), record, case.job, NOW)
    assert decision.record.checkpoint_asked == 2


def test_a_commit_summarises_the_switch() -> None:
    case = CASES["in flight: every new member trains in its epoch, commit"]
    status = decide(case.seen, case.record, case.job, NOW).status
    assert status["lastReconfiguration"] == {
        "epoch": 2, "reason": "scale 2 -> 3", "from": W2.describe(), "to": GROW.new.describe(),
        "pauseSeconds": 0.5, "bytesMoved": 1000, "result": "committed",
        "message": "epoch 2: committed",
    }  # fmt: skip
    assert (status["epoch"], status["members"], status["replicas"]) == (2, ["p0", "p1", "p2"], 3)
    assert status["readyReplicas"] == 3 and status["step"] == 10
    assert condition(status, "Degraded")["reason"] == "AsPlanned"


def test_the_status_shows_the_most_state_a_member_holds_and_what_its_mirror_costs() -> None:
    case = CASES["in flight: every new member trains in its epoch, commit"]
    unknown = decide(case.seen, case.record, case.job, NOW).status
    assert unknown["stateBytes"] is None and unknown["peerExchangeSeconds"] is None
    pods = []
    for i, member in enumerate(case.seen.pods.values()):
        agent = copy_of(member.agent)
        agent.state_bytes, agent.mirrored_bytes = 1000 + i, 300 - i
        agent.exchange_seconds = 0.001 * i
        pods.append(replace(member, agent=agent))
    status = decide(seen(*pods), case.record, case.job, NOW).status
    assert status["stateBytes"] == {"perMember": 1000 + len(pods) - 1, "mirroredPerMember": 300}
    assert status["peerExchangeSeconds"] == 0.001 * (len(pods) - 1)


MIRRORED = {"faultTolerance": {"snapshots": True}}


def test_the_first_world_puts_each_mirrored_shards_holders_on_two_nodes() -> None:
    # Two pods on each node, created node by node: in that order a node's loss would take both
    # holders of two shards.
    pods = seen(*(pod(f"p{i}", standby(), node="ab"[i // 2]) for i in range(4)))
    decision = decide(pods, Record(), job(4, **MIRRORED), NOW)
    assert str(asked(decision)).startswith("begin 0 on p0: p0,p2,p1,p3 start with")
    # Without the mirror the pods' order stands.
    assert str(asked(decide(pods, Record(), J4, NOW))).startswith("begin 0 on p0: p0,p1,p2,p3 ")


def test_a_first_world_that_uses_fewer_pods_than_are_ready_takes_them_over_nodes() -> None:
    # Five pods ready, three of them on node a, listed first; four are used: two of each node,
    # so that no mirror pair shares one.
    pods = seen(*(pod(f"p{i}", standby(), node="aaabb"[i]) for i in range(5)))
    decision = decide(pods, Record(), job(5, **MIRRORED), NOW)
    assert isinstance(decision.ask, Begin)
    new = decision.ask.plan.new.layout(job(5, **MIRRORED).model)
    assert len(new.members) == 4 and "p2" not in new.members
    assert pairs_on_one_node(new, new.members, pods.nodes()) == 0


def test_joiners_go_where_no_mirror_pair_shares_a_node_and_the_status_counts_the_pairs() -> None:
    mirrored = job(4, **MIRRORED)
    # p0 and p1 (nodes a, b) train; p2 and p3 (a, b) stand by to join, listed against their nodes.
    old = world(mirrored, ["p0", "p1"], 1)
    pods = seen(pod("p0", training(1), role=M, node="a"), pod("p1", training(1), role=M, node="b"),
                pod("p2", standby(), node="a"), pod("p3", standby(), node="b"))  # fmt: skip
    decision = decide(pods, Record(world=old), mirrored, NOW)
    assert isinstance(decision.ask, Begin)
    new = decision.ask.plan.new.layout(mirrored.model)
    node_of = pods.nodes()
    assert pairs_on_one_node(new, new.members, node_of) == 0
    assert decision.status["placement"] == {"nodes": 2, "mirrorPairs": 1, "mirrorPairsOnOneNode": 0}
    # Three pods stand by for two places, two of them on node a: a's and b's join.
    spare = seen(*pods.pods.values(), replace(pods.pods["p3"], name="p4"))
    spare = seen(*(replace(p, node="a") if p.name == "p3" else p for p in spare.pods.values()))
    decision = decide(spare, Record(world=old), mirrored, NOW)
    assert isinstance(decision.ask, Begin)
    assert set(decision.ask.plan.new.members) == {"p0", "p1", "p2", "p4"}
    # Members that were placed on one node are counted.
    crowded = seen(*(replace(p, node="a") for p in pods.pods.values()))
    status = decide(crowded, Record(world=old), mirrored, NOW).status
    assert status["placement"] == {"nodes": 1, "mirrorPairs": 1, "mirrorPairsOnOneNode": 1}


def test_survivors_whose_mirror_pairs_came_to_share_a_node_are_exchanged_live() -> None:
    # The world's ring p0-p1-p2-p3 with p0, p1 on node a and p2, p3 on b (replacements landed
    # beside their partners): a node's loss would take both holders of two shards.
    mirrored = job(4, **MIRRORED)
    old = world(mirrored, ["p0", "p1", "p2", "p3"], 1)
    pods = seen(*(pod(f"p{i}", training(1), role=M, node="aabb"[i]) for i in range(4)))
    assert pairs_on_one_node(old.layout(mirrored.model), old.members, pods.nodes()) == 2
    decision = decide(pods, Record(world=old), mirrored, NOW)
    assert isinstance(decision.ask, Begin)
    plan = decision.ask.plan
    assert plan.reason == "respread: 2 -> 0 mirror pairs on one node" and not plan.lost
    new = plan.new.layout(mirrored.model)
    assert new.degrees == old.degrees and sorted(new.members) == sorted(old.members)
    assert sum(a != b for a, b in zip(new.members, old.members, strict=True)) == 2  # one exchange
    assert pairs_on_one_node(new, new.members, pods.nodes()) == 0
    # Once committed, the world is kept; nor is one whose pairs no exchange can part moved.
    after = world(mirrored, list(new.members), 2)
    settled = seen(*(replace(p, agent=training(2)) for p in pods.pods.values()))
    assert asked(decide(settled, Record(world=after), mirrored, NOW)) is None
    crowded = seen(*(replace(p, node="a") for p in pods.pods.values()))
    stuck = decide(crowded, Record(world=old), mirrored, NOW)
    assert asked(stuck) is None
    # Which the status says: a node's loss would take both copies of a shard.
    degraded = condition(stuck.status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "MirrorPairsOnOneNode")
    assert degraded["message"].startswith("4 of 4 mirror pairs share a node, on 1 node(s)")
    for parted in (decision, decide(settled, Record(world=after), mirrored, NOW)):
        assert condition(parted.status, "Degraded")["status"] == "False"


def test_an_abort_degrades_the_job_and_says_why() -> None:
    case = CASES["in flight: an agent aborted, abort everywhere and back off"]
    decision = decide(case.seen, case.record, case.job, NOW)
    status = decision.status
    assert status["lastReconfiguration"]["result"] == "aborted"
    assert status["lastReconfiguration"]["message"] == "aborted by p0: vote no"
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReconfigurationAborted")
    (event,) = decision.after
    assert event == Event(EventType.WARNING, "ReconfigurationAborted",
                          "epoch 2 aborted (scale 2 -> 3): aborted by p0: vote no; the job keeps "
                          "its layout, retry in 5 s")  # fmt: skip


def test_failures_name_their_reason() -> None:
    split = CASES["in flight: some members committed, some aborted (a protocol breach): Failed"]
    status = decide(split.seen, split.record, split.job, NOW).status
    assert condition(status, "Failed")["reason"] == "SplitReconfiguration"
    owed = CASES["a restore owed without a checkpoint: Failed"]
    lost = decide(owed.seen, owed.record, owed.job, NOW).status
    failed = condition(lost, "Failed")
    assert (
        failed["reason"] == "NoCopyNoCheckpoint" and "no checkpoint was saved" in failed["message"]
    )


def test_hot_spares_degrade_the_job() -> None:
    case = CASES["nothing to do: a pod no layout uses stands by"]
    status = decide(case.seen, case.record, case.job, NOW).status
    assert status["spares"] == ["p4"]
    assert condition(status, "Degraded")["reason"] == "HotSpares"


def test_a_silent_member_is_deleted_saying_why() -> None:
    case = CASES["silent for twice the op deadline: its pod is deleted and it counts as lost"]
    (delete,) = decide(case.seen, case.record, case.job, NOW).after
    assert delete == DeletePod("p2", "answers nothing while its world is broken: "
                                     "agent p2: UNAVAILABLE")  # fmt: skip
    hung = CASES["still training while its world broke: hung, silent for twice the op deadline"]
    (delete,) = decide(hung.seen, hung.record, hung.job, NOW).after
    assert delete.because == "still trains while its world is broken: its training is hung"


@pytest.mark.parametrize(("kept", "deleted"), [(3, []), (1, ["p5", "p7"]), (0, ["p5", "p6", "p7"])])
def test_the_pods_of_past_members_that_ended_are_kept_but_the_last_few(
    kept: int, deleted: list[str]
) -> None:
    the_job = job(3, faultTolerance={"snapshots": False, "failedPodsHistoryLimit": kept})
    # p5, p6 and p7 were members of past worlds and ended (p6 last); p2 is the world's, lost
    # now: its pod is the recovery's until it commits.
    ended = [
        replace(pod(name, None, role=M, gone=True), ended=NOW - age)
        for name, age in (("p5", 300), ("p6", 10), ("p7", 60), ("p2", 400))
    ]
    decision = decide(seen(*TRAINING3[:2], *ended), Record(world=W3), the_job, NOW)
    assert sorted(a.pod for a in decision.after if isinstance(a, DeletePod)) == deleted


def test_a_pod_whose_deletion_was_asked_is_not_deleted_again() -> None:
    # Every pass of a pod's grace period sees it; the DELETE was sent once. The history counts
    # the ended pods not yet being deleted.
    the_job = job(3, faultTolerance={"snapshots": False, "failedPodsHistoryLimit": 1})
    ended = [
        replace(pod(name, None, role=M, gone=True), ended=NOW - age, deleting=deleting)
        for name, age, deleting in (("p5", 300, True), ("p6", 10, False), ("p7", 60, False))
    ]
    decision = decide(seen(*TRAINING3[:2], *ended), Record(world=W3), the_job, NOW)
    assert [a.pod for a in decision.after if isinstance(a, DeletePod)] == ["p7"]
    silent = CASES["silent for twice the op deadline: its pod is deleted and it counts as lost"]
    pods = {n: replace(p, deleting=True) if n == "p2" else p for n, p in silent.seen.pods.items()}
    again = decide(Observation(pods), silent.record, silent.job, NOW)
    assert not [a for a in again.after if isinstance(a, DeletePod)]
    assert again.record == decide(silent.seen, silent.record, silent.job, NOW).record


def test_the_history_limit_of_ended_pods_is_checked() -> None:
    with pytest.raises(InvalidInput, match="failedPodsHistoryLimit=-1 must be an integer >= 0"):
        job(3, faultTolerance={"failedPodsHistoryLimit": -1})


def test_new_pods_are_rendered_from_the_template() -> None:
    decision = decide(seen(), Record(), J2, NOW)
    assert decision.after == (CreatePod(render.worker_pod(J2.body, J2.spec)),) * 2


def test_the_record_round_trips_and_clears_what_it_no_longer_holds() -> None:
    record = Record(world=W3, in_flight=RECOVERY, last_epoch=2, attempts=1, retry_after=NOW,
                    restore="why", silent={"p2": NOW}, checkpoint_asked=4,
                    suspended=SAVED)  # fmt: skip
    assert Record.from_dict(record.to_dict()) == record
    assert Record.from_dict({}) == Record()
    cleared = Record(world=W3).to_dict()
    # A merge patch: None removes what the stored record had.
    assert (cleared["inFlight"], cleared["restore"], cleared["silent"], cleared["suspended"]) == (
        None, None, None, None,
    )  # fmt: skip


def test_a_suspended_job_shows_its_step_and_resumes_from_its_checkpoint() -> None:
    case = CASES["suspended: no pod is kept"]
    status = decide(case.seen, case.record, case.job, NOW).status
    assert status["step"] == 12 and status["replicas"] == 0
    suspended = condition(status, "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", "JobSuspended")
    assert suspended["message"] == "the state of step 12 is saved in /ck/suspend-1-1"
    resume = CASES[
        "resume: a first world from the suspension's checkpoint, in the layout the pods allow"
    ]
    body = {**resume.job.body, "status": status}
    decision = decide(resume.seen, resume.record, replace(resume.job, body=body), NOW)
    assert isinstance(decision.ask, Begin) and decision.ask.plan.restore == "/ck/suspend-1-1"
    resumed = condition(decision.status, "Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "JobResumed")


def test_each_reconfiguration_ended_is_kept_in_a_bounded_history() -> None:
    case = CASES["in flight: every new member trains in its epoch, commit"]
    entry = decide(case.seen, case.record, case.job, NOW).status["history"]
    assert entry == [{
        "epoch": 2, "reason": "scale 2 -> 3", "from": W2.describe(), "to": GROW.new.describe(),
        "pauseSeconds": 0.5, "bytesMoved": 1000, "result": "committed",
        "message": "epoch 2: committed",
        "step": 10, "time": "1970-01-12T13:46:40Z",
    }]  # fmt: skip
    # A pass that ends the same reconfiguration again (its status write lost) adds nothing.
    body = {**case.job.body, "status": {"history": entry}}
    again = decide(case.seen, case.record, replace(case.job, body=body), NOW).status
    assert again["history"] == entry
    # The oldest entries go once there are HISTORY of them.
    full = [{**entry[0], "epoch": e} for e in range(-HISTORY, 0)]
    body = {**case.job.body, "status": {"history": full}}
    history = decide(case.seen, case.record, replace(case.job, body=body), NOW).status["history"]
    assert len(history) == HISTORY and history[0]["epoch"] == -HISTORY + 1
    assert history[-1] == entry[0]


def test_an_epoch_pending_at_a_member_though_given_up_is_aborted_there() -> None:
    # Epoch 2 was given up (nothing in flight); p1 took its Prepare after the abort went out,
    # and would refuse every later change. p3, standing by, took it too: any change supersedes
    # it there.
    late = pod("p1", training(1, pending=pending(2)), role=M)
    pods = seen(TRAINING3[0], late, TRAINING3[2], pod("p3", standby(pending=pending(2))))
    before = decide(pods, Record(world=W3, last_epoch=2), job(4), NOW).before
    assert [a for a in before if isinstance(a, AbortOn)] == [AbortOn("p1", 2)]
    # Not an epoch this record never began, nor the one in flight (whose own progress decides).
    for record in (
        Record(world=W3, last_epoch=1),
        Record(world=W3, in_flight=SHRINK, last_epoch=2),
    ):
        before = decide(pods, record, J3, NOW).before
        assert not any(isinstance(a, AbortOn) for a in before)
    # Nor once a drop of it is queued there (an Abort asked only to queue it): it drops it at
    # its next step boundary.
    dropping = pb.Pending(epoch=2, state=pb.Pending.PREPARED, dropping=True)
    pods = seen(TRAINING3[0], pod("p1", training(1, pending=dropping), role=M), TRAINING3[2])
    before = decide(pods, Record(world=W3, last_epoch=2), job(4), NOW).before
    assert not any(isinstance(a, AbortOn) for a in before)
