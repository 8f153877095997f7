"""Worker pods that fail before they ever become members: a container that ends with an error (a
missing data path, a model too big for the pod's memory limit, a command the image lacks), one in
a crash loop, or an agent that reports FAILED (it refused its job's configuration). Creating a new
pod for each at once, pass after pass, would only crash again in a tight loop, so, as a Kubernetes
Job counts its failed pods against its backoffLimit:

- each failed pod counts once (the record keeps the names of those not deleted yet) and is gone
  for the rest of the pass: nothing waits for it, and a new pod takes its place, but no new pod is
  created before a backoff of 10 s doubling to 5 minutes with each failure in a row;
- the failed pod stays until then (its logs can be read) and is deleted when it may be replaced;
- a Warning Event `WorkerCrashing` names each, with the kubelet's reason, exit code and the last
  lines of its termination message, and the Degraded condition (reason `WorkerCrashing`) says so
  while the row lasts; a pod scheduled after the last failure that becomes ready ends it;
- after `spec.scheduling.maxStartFailures` in a row, a job that has no world and cannot start one
  is Failed (`WorkersCrashing`): its pods that still run are released and deleted, the failed ones
  kept for their logs. A job with a world trains on with the members it has, Degraded, and goes on
  trying new pods as the backoff allows.

A pod that was a member (it has one's label, or the record's worlds name it) is not counted here:
its loss is a recovery's. Pure, like `decide`.
"""

from __future__ import annotations

from dataclasses import replace

from liveshard.v1 import agent_pb2 as pb

from . import render
from .actions import Action, DeletePod, Event, EventType, ReleaseMember
from .decision import Draft
from .observation import Observation, Pod
from .publish import Failure, Missing
from .world import StartFailures

FIRST_BACKOFF = 10.0  # seconds before the pod that replaces the first failed one
MAX_BACKOFF = 300.0
REASON = "WorkerCrashing"  # the Event's and the Degraded condition's
FAILED = "WorkersCrashing"  # the Failed condition's


def backoff(count: int) -> float:
    """Seconds before a new pod after `count` failed starts in a row."""
    return min(FIRST_BACKOFF * 2.0 ** max(count - 1, 0), MAX_BACKOFF)


def failed_start(pod: Pod, members: set[str]) -> str:
    """Why `pod` failed before it became a member ("": it did not, or it was one)."""
    if pod.name in members or pod.role == render.MEMBER or pod.leaving:
        return ""
    if pod.failure:
        return pod.failure
    if pod.agent is not None and pod.agent.phase == pb.AgentStatus.FAILED:
        return f"agent: {pod.agent.message or 'failed'}"
    return ""


def note(draft: Draft, members: set[str]) -> bool:
    """Count, report and replace with backoff the pods that failed to start (see the module's
    docstring); `members`: those of the worlds the record names. True when the job fails."""
    seen, now = draft.seen, draft.now
    failing = {p.name: why for p in _by_age(seen) if (why := failed_start(p, members))}
    failed: dict[str, str] = {}  # per pod: its members fail together
    for name, why in failing.items():
        failed.setdefault(seen.pod_name(name), why)
    row = draft.record.start_failures
    here = {p.pod_name for p in seen.pods.values()}
    row = replace(row, pods=tuple(p for p in row.pods if p in here))
    draft.seen = Observation({n: replace(p, gone=True) if n in failing else p
                              for n, p in seen.pods.items()})  # fmt: skip
    if row.count and any(p.ready and p.since >= int(row.at) for p in draft.seen.live()):
        row = replace(row, count=0, last="", at=0.0, retry_after=0.0)  # one started fine
    new = [n for n in failed if n not in row.pods]
    fails = bool(new) and _fails(draft, row.count + len(new))
    for name in new:
        count = row.count + 1
        row = replace(row, count=count, last=f"{name}: {failed[name]}", at=now,
                      retry_after=now + backoff(count), pods=(*row.pods, name))  # fmt: skip
        then = "" if fails else f"; a new pod in {backoff(count):.0f} s"
        message = f"{name} failed before it became a member ({count} in a row): {failed[name]}"
        draft.after.append(Event(EventType.WARNING, REASON, message + then))
    draft.record = replace(draft.record, start_failures=row)
    if fails:
        _fail(draft, failing)
        return True
    if now >= row.retry_after:  # its replacement may be created: the failed pod goes
        for name in failing:
            _delete(draft, seen.pods[name], f"failed before it became a member: {failing[name]}")
    if row.count:
        draft.missing = Missing(REASON, _summary(draft, row))
    return False


def _by_age(seen: Observation) -> list[Pod]:
    return sorted(seen.pods.values(), key=lambda p: (p.created, p.name))


def _fails(draft: Draft, count: int) -> bool:
    """Whether a new failure, the `count`th in a row, ends the job: it has no world, none is
    in flight, and too few pods stand by to start one."""
    record, spec = draft.record, draft.job.spec
    if count < spec.max_start_failures or record.world or record.in_flight:
        return False
    return len([p for p in draft.seen.live() if p.standing_by]) < max(spec.min_replicas, 1)


def _fail(draft: Draft, failed: dict[str, str]) -> None:
    row = draft.record.start_failures
    message = (
        f"{row.count} worker pods failed before any became a member (spec.scheduling."
        f"maxStartFailures={draft.job.spec.max_start_failures}); the last, {row.last}"
    )
    draft.failure = Failure(FAILED, message)
    draft.missing = Missing(REASON, message)
    draft.after.append(Event(EventType.WARNING, FAILED, message))
    for pod in draft.seen.pods.values():  # the failed ones stay, for their logs
        if not pod.gone and not pod.leaving:
            draft.before += [ReleaseMember(pod.name), DeletePod(pod.pod_name)]
    for name in failed:  # unless they still run (an agent that reports FAILED)
        pod = draft.seen.pods[name]
        if pod.agent is not None:
            _delete(draft, pod, "failed before it became a member", draft.before)


def _delete(draft: Draft, pod: Pod, why: str, actions: list[Action] | None = None) -> None:
    out = draft.after if actions is None else actions
    if pod.agent is not None:  # an agent that reports FAILED serves until released
        out.append(ReleaseMember(pod.name))
    out.append(DeletePod(pod.pod_name, because=why))


def _summary(draft: Draft, row: StartFailures) -> str:
    world = draft.record.world
    wait = row.retry_after - draft.now
    then = f"a new pod in {wait:.0f} s" if wait > 0 else "new pods are created"
    if world is not None and row.count >= draft.job.spec.max_start_failures:
        then = f"training on with the {len(world.members)} members it has; {then}"
    return f"{row.count} worker pod(s) failed to start in a row, the last {row.last}; {then}"
