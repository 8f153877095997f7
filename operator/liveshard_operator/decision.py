"""One reconcile pass's decision as a value (`Decision`), the draft a pass fills in to make it
(`Draft`), and how the answers to its asks complete it (`hosted`, `not_hosted`, `checkpointed`).

A decision to begin a reconfiguration is an ask (`Begin`): its store's address, which only the
member asked to host it knows, goes into the record that the reconfiguration is in flight, and
that record must be written before any member is asked to prepare (a restarted operator then
resumes or aborts the reconfiguration, and never leaves members prepared for an epoch no record
names). The executor asks the host within the pass and gives the answer to `hosted` or
`not_hosted`, which return the decision it then writes and carries out: the Prepare calls come
after the write. Asking the members for a checkpoint is the other ask: the record says it was
asked only once every member took it (`checkpointed`), so a refusal is asked again next pass.

Pure, like everything the decision is made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from . import publish, render
from .actions import (
    Action,
    Ask,
    Begin,
    Checkpoint,
    CreatePod,
    DeletePod,
    Event,
    EventType,
    LabelPod,
    Prepare,
    ReleaseMember,
)
from .observation import Job, Observation, Pod, trains_in
from .publish import Failure, Missing, Report, Summary
from .world import InFlight, Record


@dataclass(frozen=True)
class Decision:
    """What one pass does. The executor does `before`, answers `ask` (which gives the decision
    it goes on with), writes `status` once, then does `after`.

    `before` holds what the status will say has happened: abort requests (the abort is recorded
    after them; a restarted operator that still finds the reconfiguration in flight aborts it
    again) and a finished job's releases and deletions (a job marked Succeeded is not looked at
    again). `after` holds what the written record makes safe (Prepare once the reconfiguration
    is recorded in flight, the members that left released once the commit is recorded, a silent
    member's pod deleted once its silence is recorded) and everything else.
    """

    job: Job
    seen: Observation
    now: float
    record: Record
    report: Report = field(default_factory=Report)
    before: tuple[Action, ...] = ()
    after: tuple[Action, ...] = ()
    ask: Ask | None = None
    unaborted: Record | None = None  # the record an abort in `before` would leave behind

    @cached_property
    def status(self) -> dict[str, Any]:
        """The status patch to write: the record and what the pass reports (made once: the
        executor writes it, the metrics read its phase)."""
        return publish.status(self.job, self.seen, self.record, self.report, self.now)

    @cached_property
    def news(self) -> bool:
        """Whether writing `status` changes more of the job's status than the training's
        progress (`publish.news`)."""
        return publish.news(self.job.status, self.status)


@dataclass
class Draft:
    """The decision as one pass builds it: the record it will leave, what it will report, and
    the actions and ask it has decided so far."""

    seen: Observation
    record: Record
    job: Job
    now: float
    message: str = ""
    spares: list[str] = field(default_factory=list)
    last: Summary | None = None
    failure: Failure | None = None
    finished: bool = False
    exported: str = ""
    missing: Missing | None = None
    before: list[Action] = field(default_factory=list)
    after: list[Action] = field(default_factory=list)
    ask: Ask | None = None
    unaborted: Record | None = None

    def decision(self) -> Decision:
        report = Report(self.message, tuple(self.spares), self.last, self.failure,
                        self.finished, self.exported, self.missing)  # fmt: skip
        deleting = {p.pod_name for p in self.seen.pods.values() if p.deleting}
        return Decision(self.job, self.seen, self.now, self.record, report,
                        _once(self.before, deleting), _once(self.after, deleting), self.ask,
                        self.unaborted)  # fmt: skip

    def keep_pods(self, wanted: int, members: set[str], saved: int = 0) -> None:
        """Create pods until `wanted` live members exist, unless pods that failed to start hold
        creations back (`start_failures`); delete surplus pods none of whose members is in
        `members`, newest first (`saved`: see `ReleaseMember`)."""
        live = self.seen.live()
        backing_off = self.now < self.record.start_failures.retry_after
        for _ in range(0 if backing_off else self.job.spec.pods(wanted - len(live))):
            self.after.append(CreatePod(render.worker_pod(self.job.body, self.job.spec)))
        surplus = len(live) - wanted
        for pod, mates in reversed(by_pod(live).items()):
            if len(mates) <= surplus and not any(m.name in members for m in mates):
                self.after += [*(ReleaseMember(m.name, saved) for m in mates), DeletePod(pod)]
                surplus -= len(mates)

    def label(self, members: set[str]) -> None:
        """Label the pods of `members` as the world's (the scale selector's) and every other pod
        standby."""
        for pod, mates in by_pod(list(self.seen.pods.values())).items():
            role = render.MEMBER if any(m.name in members for m in mates) else render.STANDBY
            if any(m.role != role and not m.gone for m in mates):
                self.after.append(LabelPod(pod, role))


def _once(actions: list[Action], deleting: set[str]) -> tuple[Action, ...]:
    """`actions` with each pod deleted once (a pod of several members is named by each), and
    none whose deletion was asked already (`deleting`: asked again, every pass of its grace
    period would send a DELETE)."""
    deleted = set(deleting)
    out = []
    for action in actions:
        if isinstance(action, DeletePod):
            if action.pod in deleted:
                continue
            deleted.add(action.pod)
        out.append(action)
    return tuple(out)


def by_pod(seen: list[Pod]) -> dict[str, list[Pod]]:
    """`seen`'s members grouped by pod, in the order of each pod's first member."""
    out: dict[str, list[Pod]] = {}
    for member in seen:
        out.setdefault(member.pod_name, []).append(member)
    return out


def prepares(job: Job, seen: Observation, plan: InFlight) -> list[Prepare]:
    """Prepare for every member of the change that has not taken it yet."""
    spec = job.spec
    old = plan.old.layout(job.model) if plan.old else None
    new = plan.new.layout(job.model)
    out = []
    for member in plan.union():
        pod = seen.pods.get(member)
        agent = pod.agent if pod is not None else None
        if agent is None or trains_in(agent, plan.epoch):
            continue
        if agent.HasField("pending") and agent.pending.epoch == plan.epoch:
            continue
        out.append(Prepare(
            member, plan.epoch, plan.store, new, old, plan.lost, spec.budget_bytes,
            spec.deadlines, plan.restore, plan.pods,
        ))  # fmt: skip
    return out


def hosted(decision: Decision, store: tuple[str, int]) -> Decision:
    """`decision` once the host of the reconfiguration it begins serves its store at `store`:
    the reconfiguration recorded in flight, announced, and Prepare sent after the write."""
    begin = _begun(decision)
    plan = replace(begin.plan, store=store)
    restore = "" if begin.restores else decision.record.restore  # owed no more once begun
    record = replace(decision.record, in_flight=plan, last_epoch=plan.epoch, restore=restore)
    before = plan.old.describe() if plan.old else "nothing"
    change = f"epoch {plan.epoch}: {plan.reason}: {before} -> {plan.new.describe()}"
    event = Event(EventType.NORMAL, "Reconfiguring", change)
    after = (*decision.after, event, *prepares(decision.job, decision.seen, plan))
    return replace(decision, record=record, after=after, ask=None)


def not_hosted(decision: Decision, error: str) -> Decision:
    """`decision` when no store could be hosted: nothing begins, the status says why."""
    begin = _begun(decision)
    message = f"epoch {begin.plan.epoch}: hosting the store on {begin.host}: {error}"
    return replace(decision, report=replace(decision.report, message=message), ask=None)


def checkpointed(decision: Decision, taken: bool) -> Decision:
    """`decision` once every member took the checkpoint request (`taken`), or one refused it
    (nothing is recorded: the next pass asks again)."""
    checkpoint = decision.ask
    if not isinstance(checkpoint, Checkpoint):
        raise ValueError(f"the decision asks {checkpoint!r}, not for a checkpoint")
    record = decision.record
    if taken:
        record = replace(record, checkpoint_asked=checkpoint.number)
    return replace(decision, record=record, ask=None)


def overtaken(decision: Decision, member: str, why: str) -> Decision:
    """`decision` when `member` refused its abort because the epoch is in effect there: the
    commit came first (everywhere: the agents act on one recorded decision). Nothing of the abort
    is recorded or announced; the next pass sees the commit."""
    assert decision.unaborted is not None, "no abort was decided"
    plan = decision.unaborted.in_flight
    epoch = plan.epoch if plan is not None else "?"
    message = f"epoch {epoch}: the abort came after the commit on {member} ({why})"
    after = tuple(a for a in decision.after if not isinstance(a, Event))
    report = replace(decision.report, message=message, last=None)
    return replace(decision, record=decision.unaborted, report=report, after=after,
                   unaborted=None)  # fmt: skip


def _begun(decision: Decision) -> Begin:
    if not isinstance(decision.ask, Begin):
        raise ValueError(f"the decision asks {decision.ask!r}, not to host a store")
    return decision.ask
