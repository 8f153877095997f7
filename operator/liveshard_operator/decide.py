"""What one reconcile pass of a job does, decided from what it saw: a pure function of the job's
pods and their agents' statuses, the record the last pass left in status, the job's spec, its
model and the time. It returns the actions to take and the record and status to write (`Decision`);
`act` carries them out. No I/O, no clock, no gRPC here.

Each pass compares what the job asks for (its spec: the replica count, the constraints) with what
is (the pods, what their agents say, the world and the reconfiguration in flight as recorded) and
does one thing:
- no world yet: create the pods, wait until minReplicas agents are ready (pre-warmed) and no
  other pod is about to be, choose a layout, have a member host the store, and ask every member
  to start the first world;
- a reconfiguration in flight: finish it when every new member trains in its epoch (release the
  members that left, delete their pods), or abort it everywhere when an agent reports an abort,
  a failed prepare, a pod vanishes or its deadline passes (then retry with backoff);
- otherwise: replace leaving or lost members at once (a drained node, a deleted pod: the pod's
  grace period is the budget; a pod that ended without notice took its state along, and its
  bytes come from surviving copies), follow the replica count (new pods pre-warm as standby
  first; the pods that land together join together; a pod the scheduler cannot place holds
  nothing up and is reported missing), and start a reconfiguration when the layout or the
  members must change; with nothing else to do, exchange members of a mirrored world whose
  copies share a node (`_respread`), or else rebalance the pipeline from the costs the members
  measure (`rebalance`: a world rebalanced or packed is kept as it is);
- a worker pod that failed before it became a member (it crashed, or its agent refused the job's
  configuration) is replaced with backoff, and the job Failed when too many fail in a row before
  it has a world (`start_failures`);
- a recovery from a lost member that aborted (no surviving copy of some state, or survivors that
  stopped in different states) cannot succeed by retrying: the job starts a new first world from
  its last saved checkpoint with the pods it has (its step goes back to the checkpoint's), or is
  Failed when it saved none.

A decision to begin a reconfiguration or to take a checkpoint is an *ask* whose answer the
executor gives back before it writes anything (`decision`); a reconfiguration in flight is
`inflight`'s to decide.
"""

from __future__ import annotations

from dataclasses import replace

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput
from liveshard_core.plan.plan import source_layout

from . import checkpoints, policy, rebalance, render, start_failures
from .actions import AbortOn, Begin, Checkpoint, DeletePod, Event, EventType, ReleaseMember
from .decision import Decision, Draft, by_pod
from .inflight import progress
from .observation import Job, Observation, Pod
from .publish import Failure, Missing
from .world import InFlight, Record, Suspension, World

_RESTARTABLE = (pb.AgentStatus.STANDBY, pb.AgentStatus.BROKEN)  # may join a restored first world
_NO_STORE = ("", 0)  # a plan's store until its host answers


def decide(seen: Observation, record: Record, job: Job, now: float) -> Decision:
    """The next idempotent step of `job` (see the module's docstring)."""
    draft = Draft(seen, record, job, now)
    _note_failed_checkpoint(draft)
    in_world = set(record.in_flight.union() if record.in_flight else ())
    if record.in_flight and record.in_flight.old:  # a lost member's pod is the recovery's
        in_world.update(record.in_flight.old.members)
    in_world.update(record.world.members if record.world else ())
    if start_failures.note(draft, in_world):
        return draft.decision()
    _prune_ended(draft, in_world)
    _note_missing(draft, in_world)
    _drop_given_up(draft)
    if record.in_flight is not None:
        progress(draft, record.in_flight)
    elif job.spec.suspend and _suspend(draft):
        pass
    elif record.world is None:
        _start(draft)
    else:
        _steady(draft, record.world)
    return draft.decision()


# ---- what the agents say ----


def _broken(pod: Pod | None) -> bool:
    return pod is not None and pod.agent is not None and pod.agent.phase == pb.AgentStatus.BROKEN


def _done(pod: Pod | None) -> bool:
    return pod is not None and _done_agent(pod.agent)


def _done_agent(agent: pb.AgentStatus | None) -> bool:
    return agent is not None and agent.phase == pb.AgentStatus.DONE


def _prune_ended(draft: Draft, in_world: set[str]) -> None:
    """Delete the pods of past members that ended (a process killed, OOM, a failed container),
    but the `failedPodsHistoryLimit` that ended last: kept for their logs, the rest would pile up
    over a long run. A pod one of whose members the record's worlds still name is the recovery's
    (it goes once the recovery committed)."""
    ended = [
        mates[0] for mates in by_pod(list(draft.seen.pods.values())).values()
        if mates[0].gone and mates[0].role == render.MEMBER
        and not any(m.name in in_world for m in mates)
    ]  # fmt: skip
    oldest_first = sorted(ended, key=lambda p: (p.ended, p.created, p.pod_name))
    for pod in oldest_first[: max(len(oldest_first) - draft.job.spec.failed_pods_kept, 0)]:
        draft.after.append(DeletePod(pod.pod_name))


def _drop_given_up(draft: Draft) -> None:
    """Abort an epoch pending at a training member though the record gave it up: a Prepare the
    agent took after the abort went out (a call past its deadline, taken all the same). Left
    pending, it would refuse every later change there (unless its drop is queued there already:
    `dropping`); at a member that does not train, any later change supersedes it."""
    record = draft.record
    flying = record.in_flight.epoch if record.in_flight else None
    committed = record.world.epoch if record.world else None
    for name, pod in draft.seen.pods.items():
        agent = pod.agent
        if agent is None or pod.gone or agent.phase != pb.AgentStatus.TRAINING:
            continue
        if not agent.HasField("pending") or agent.pending.dropping:  # dropping: told already
            continue
        epoch = agent.pending.epoch
        if epoch not in (flying, committed) and epoch <= record.last_epoch:
            draft.before.append(AbortOn(name, epoch))


# ---- the first world ----


def _start(draft: Draft) -> None:
    spec = draft.job.spec
    wanted, least = spec.replicas, max(spec.min_replicas, 1)
    draft.keep_pods(wanted, set())
    ready = [p for p in draft.seen.live() if p.standing_by]
    landing = _landing(draft, set())
    if wanted == 0 or len(ready) < least or (landing and len(ready) < wanted):
        pre_warming = f", {len(landing)} pre-warming" if landing else ""
        draft.message = (
            f"waiting for ready pods: {len(ready)} of {wanted} ready{pre_warming} "
            f"({least} to start)"
        )
        return
    if _backing_off(draft):
        return
    try:
        choice = policy.choose(draft.job.model, spec, min(wanted, len(ready)))
    except InvalidInput as err:
        draft.message = str(err)
        return
    members = policy.pick(choice.degrees, [p.name for p in ready], choice.used,
                          draft.seen.nodes(), draft.seen.pod_of())  # fmt: skip
    layout = choice.degrees.layout(draft.job.model, members)
    short = f"{len(ready)} of {wanted} pods: " if len(ready) < wanted else ""
    reason = f"start with {short}{choice.why}"
    restore, suspended = spec.restore_from, draft.record.suspended
    if suspended is not None:
        restore = suspended.path
        reason = f"resume from {restore} (step {suspended.step}); {reason}"
    elif restore:
        reason = f"{reason}, from {restore}"
    _begin(draft, InFlight(
        epoch=_next_epoch(draft), reason=reason, new=World.of(0, layout), store=_NO_STORE,
        started=draft.now, restore=restore,
    ))  # fmt: skip


# ---- a world exists ----


def _steady(draft: Draft, world: World) -> None:
    if draft.record.suspended is not None:  # resumed (or cancelled before it was saved)
        draft.record = replace(draft.record, suspended=None)
    if draft.record.restore:
        _restore(draft, draft.record.restore)
        return
    spec, model = draft.job.spec, draft.job.model
    pods, members = draft.seen.pods, list(world.members)
    if any(_done(pods.get(m)) for m in members):
        _finish(draft, world)
        return
    lost = [m for m in members if m not in pods or pods[m].gone] + _silent(draft, members)
    # Every member says its world broke and none is lost (a partition between members, or one
    # slower than the op deadline): the world is built again, in its own layout.
    rebuild = not lost and all(_broken(pods.get(m)) for m in members)
    leaving = [m for m in members if m in pods and pods[m].leaving and m not in lost]
    stayers = [m for m in members if m not in lost and m not in leaving]
    standby = [p for p in draft.seen.live() if p.standing_by and p.name not in members]
    landing = _landing(draft, set(members))
    wanted = rebalance.replicas(draft)  # spec.replicas, less what packing released
    stayers, standby = _whole_pods(draft, stayers, standby, wanted)
    draft.keep_pods(wanted, set(members))
    draft.label(set(members))
    for pod in pods.values():  # a standing-by pod that must go holds no state
        if pod.leaving and pod.name not in members:
            draft.after.append(ReleaseMember(pod.name))
    urgent = lost or leaving or rebuild
    candidates = stayers + [p.name for p in standby]
    target = min(wanted, len(candidates))
    if not urgent and landing and len(candidates) < wanted:
        draft.message = f"pre-warming {len(landing)} pod(s)"  # the standby pods wait with them
        return
    draft.spares = [p.name for p in standby]
    if target == 0:
        draft.message = "no member can be kept: every member is leaving or lost"
        return
    try:
        choice = policy.choose(model, spec, target)
    except InvalidInput as err:
        draft.message = str(err)
        return
    old = world.layout(model)
    joiners = [p.name for p in standby]
    # Survivors are placed on what the plan reads from them (`source_layout`).
    source = source_layout(old, frozenset(lost))
    new_members = policy.assign(model, source, choice.degrees, stayers, joiners,
                                draft.seen.nodes(), draft.seen.pod_of())  # fmt: skip
    draft.spares = [p.name for p in standby if p.name not in new_members]
    if rebuild:
        _begin(draft, InFlight(
            epoch=_next_epoch(draft), reason="rebuild: every member's world broke, none is lost",
            new=World.of(0, old), store=_NO_STORE, started=draft.now, old=world,
        ))  # fmt: skip
        return
    layout = choice.degrees.layout(model, new_members)
    if layout == old or (not urgent and rebalance.keeps(draft, old, layout)):
        if len(candidates) > choice.used:
            draft.message = (
                f"{len(candidates) - choice.used} pod(s) stand by as hot spares: no layout "
                f"of {model.config.name} uses {len(candidates)} members ({choice.why})"
            )
        _checkpoint_if_due(draft, world)
        # A checkpoint asked and not saved when a switch commits is asked again (`_commit`).
        if draft.ask is None and not _backing_off(draft):
            move = _respread(draft, world) or rebalance.consider(
                draft, world, [p.name for p in standby]
            )
            if move is not None:
                _begin(draft, InFlight(
                    epoch=_next_epoch(draft), reason=move.reason, new=World.of(0, move.layout),
                    store=_NO_STORE, started=draft.now, old=world,
                ))  # fmt: skip
        return
    if _backing_off(draft) and not urgent:
        return
    reasons = []
    if lost:
        reasons.append(f"lost {', '.join(lost)}")
    if leaving:
        reasons.append(f"evicting {', '.join(leaving)}")
    if len(new_members) != len(members) and not urgent:
        reasons.append(f"scale {len(members)} -> {len(new_members)}")
    _begin(draft, InFlight(
        epoch=_next_epoch(draft), reason="; ".join(reasons) or "new layout",
        new=World.of(0, layout), store=_NO_STORE, started=draft.now, old=world, lost=tuple(lost),
    ))  # fmt: skip


def _whole_pods(
    draft: Draft, stayers: list[str], standby: list[Pod], wanted: int
) -> tuple[list[str], list[Pod]]:
    """The stayers and standby members left when pods of several members shrink to `wanted`
    members: whole pods leave, those with the fewest stayers first (standing-by pods), the
    newest first among equals. Pods of one member are left to the assignment, which keeps the
    stayers that move the fewest bytes."""
    if draft.job.spec.members_per_pod == 1:
        return stayers, standby
    pods = draft.seen.pods
    groups = by_pod([pods[m] for m in stayers] + standby)
    excess = len(stayers) + len(standby) - wanted
    dropped = set()
    newest = sorted(groups.items(), key=lambda g: g[1][0].created, reverse=True)
    for pod, mates in sorted(newest, key=lambda g: sum(m.name in stayers for m in g[1])):
        if len(mates) <= excess:
            dropped.add(pod)
            excess -= len(mates)
    return ([m for m in stayers if pods[m].pod_name not in dropped],
            [p for p in standby if p.pod_name not in dropped])  # fmt: skip


def _respread(draft: Draft, world: World) -> rebalance.Move | None:
    """A mirrored world some of whose mirror pairs share a node (its survivors kept their ranks
    while their partners were replaced there) where exchanging members would part some: the
    same layout with those members exchanged, so that a node's loss costs fewer bytes."""
    seen = draft.seen
    found = policy.respread(world.degrees, world.members, seen.nodes(), bool(seen.pod_of()))
    if found is None:
        return None
    members, shared, after = found
    reason = f"respread: {shared} -> {after} mirror pairs on one node"
    return rebalance.Move(world.degrees.layout(draft.job.model, members), reason)


# ---- suspension ----


def _suspend(draft: Draft) -> bool:
    """Suspend the job (spec.suspend): once every member trains (a recovery or the job's end
    comes first: False, the pass goes on as if not suspending), ask them for a checkpoint at
    their next step; once saved, record it, leave the world and release every pod. With no
    world, keep no pod. True when this pass did what the suspension asks."""
    record = draft.record
    world = record.world
    if world is None:
        draft.keep_pods(0, set(), record.suspended.number if record.suspended else 0)
        return True
    pods = draft.seen.pods
    agents = [pods[m].agent if m in pods else None for m in world.members]
    if not all(a is not None and a.phase == pb.AgentStatus.TRAINING for a in agents):
        return False
    speaker = agents[0]
    assert speaker is not None
    saved = [a.last_checkpoint for a in agents if a is not None]
    taken = max(c.number for c in saved)
    saving = record.suspended
    # None yet, one the job resumed from, or one whose number another checkpoint took (a
    # periodic one, asked by a pass whose record this one did not see yet, saved since).
    if (
        saving is None
        or saving.saved
        or (taken >= saving.number and all(c.path != saving.path for c in saved))
    ):
        saving = _suspension(draft, world, max(record.checkpoint_asked, taken) + 1)
        draft.record = replace(record, suspended=saving)
    if all(c.number >= saving.number for c in saved) and saved[0].path == saving.path:
        step = int(saved[0].step)
        draft.record = replace(draft.record, world=None, suspended=replace(saving, step=step))
        draft.keep_pods(0, set(), saving.number)
        draft.after.append(Event(
            EventType.NORMAL, "Suspended", f"suspended at step {step}: state saved to {saving.path}"
        ))  # fmt: skip
        return True
    draft.message = f"suspending: saving the state of step >= {speaker.step} to {saving.path}"
    failed = checkpoints.last_failed(draft.job, draft.seen, draft.now)
    if failed is not None and failed.number >= saving.number:
        wait = failed.seconds + checkpoints.RETRY_SECONDS - draft.now
        if wait > 0:
            draft.message = f"suspending: {failed.describe()}; asking again in {wait:.0f} s"
            return True
        saving = _suspension(draft, world, max(record.checkpoint_asked, failed.number) + 1)
        draft.record = replace(draft.record, suspended=saving)
    if record.checkpoint_asked < saving.number:
        draft.ask = Checkpoint(world.members, saving.number, saving.path, int(speaker.step))
    return True


def _suspension(draft: Draft, world: World, number: int) -> Suspension:
    """A suspension saved as checkpoint `number` of `world`. Its directory names the epoch too:
    the periodic checkpoints' numbers follow the step, so one after a resume can take the same
    number again; an epoch is never taken twice."""
    return Suspension(number, _checkpoint_dir(draft, f"suspend-{world.epoch}-{number}"))


# ---- capacity as it lands ----


def _landing(draft: Draft, members: set[str]) -> list[Pod]:
    """Pods outside `members` about to be ready: placed by the scheduler (or not judged yet) and
    not ready for less than spec.scheduling.pendingTimeoutSeconds. A start or a growth waits for
    them, so that pods landing together join in one reconfiguration; a pod the scheduler cannot
    place holds nothing up."""
    timeout = draft.job.spec.pending_timeout
    return [p for p in draft.seen.live() if p.name not in members and not p.ready
            and not p.unschedulable and draft.now - p.since < timeout]  # fmt: skip


def _note_missing(draft: Draft, members: set[str]) -> None:
    """Report the pods outside `members` that the job goes on without (the Degraded condition):
    those the scheduler cannot place, with its reason, and those not ready in time."""
    awaited = {p.name for p in _landing(draft, members)}
    missing = [mates[0] for mates in by_pod([
        p for p in draft.seen.live()
        if p.name not in members and not p.ready and p.name not in awaited
    ]).values()]  # fmt: skip
    if not missing or draft.missing is not None:  # pods failing to start say more
        return

    def why(pod: Pod) -> str:
        if pod.unschedulable:
            return f"{pod.pod_name} cannot be scheduled: {pod.unschedulable}"
        late = f"{draft.now - pod.since:.0f} s"
        return f"{pod.pod_name} not ready {late} after it was scheduled: {pod.error or 'starting'}"

    verdicts = [p.unschedulable.split(":")[0] for p in missing if p.unschedulable]
    spec = draft.job.spec
    message = f"{len(missing)} of {spec.pods(spec.replicas)} pods missing, going on without them"
    draft.missing = Missing(
        verdicts[0] if verdicts else "PendingTimeout",
        "; ".join([message, *(why(p) for p in missing[:3])]),
    )


def _silent(draft: Draft, members: list[str]) -> list[str]:
    """Members that have not said their world broke within `Deadlines.silent` while another's
    did: their agent answers nothing (dead, or its node cut off), or answers but its member
    still trains (its training thread hangs: a collective it was in would have failed by now).
    They hold up the others; their pods are deleted and they count as lost. The time each was
    first seen silent is recorded (before its pod is deleted), so the deadline holds across
    passes and restarts."""
    pods, now = draft.seen.pods, draft.now
    broken = any(_broken(pods.get(m)) for m in members)
    silent = [m for m in members if broken and m in pods and not pods[m].gone
              and not _broken(pods[m])]  # fmt: skip
    recorded = draft.record.silent
    since = {m: t for m, t in recorded.items() if m in silent}
    since.update({m: now for m in silent if m not in since})
    draft.record = replace(draft.record, silent=since)
    out = [m for m in silent if now - since[m] >= draft.job.spec.deadlines.silent]
    for member in out:
        agent = pods[member].agent
        why = (f"answers nothing while its world is broken: {pods[member].error}" if agent is None
               else "still trains while its world is broken: its training is hung")  # fmt: skip
        draft.after.append(DeletePod(pods[member].pod_name, because=why))
    return out


def _finish(draft: Draft, world: World) -> None:
    """The job trained its last step: once exported if it asks for that, release every agent
    and delete the pods."""
    export = draft.job.spec.export_to
    if export and not _exported(draft, world, export):
        return
    draft.finished = True
    for pod in draft.seen.pods.values():
        draft.before += [ReleaseMember(pod.name), DeletePod(pod.pod_name)]


def _exported(draft: Draft, world: World, export: str) -> bool:
    """Whether the job's last step was exported to `export`, or cannot be (the message says
    which). If not yet: once every member has trained the last step (they keep their state),
    ask them for its checkpoint, which they save at once and the first exports."""
    pods, last = draft.seen.pods, draft.job.spec.training.steps
    agents = [pods[m].agent if m in pods and not pods[m].gone else None for m in world.members]
    speaker = agents[0]
    saved = speaker.last_checkpoint if speaker is not None else pb.CheckpointSummary()
    if saved.exported_to == export:
        draft.exported = export
        draft.message = f"exported step {saved.step} to {export}"
        return True
    failed = checkpoints.last_failed(draft.job, draft.seen, draft.now)
    if failed is not None and failed.number >= draft.record.checkpoint_asked:
        draft.message = f"not exported to {export}: {failed.describe()}"
        return True
    unable = saved.export_error or next(
        (f"{m} is gone" for m, a in zip(world.members, agents, strict=True)
         if a is None or a.phase not in (pb.AgentStatus.DONE, pb.AgentStatus.TRAINING)),
        "",
    )  # fmt: skip
    if unable:
        draft.message = f"not exported to {export}: {unable}"
        return True
    draft.message = f"exporting step {last} to {export}"
    asked = draft.record.checkpoint_asked
    if all(_done_agent(a) for a in agents) and asked <= saved.number:
        number = max(asked, saved.number) + 1
        path = _checkpoint_dir(draft, f"step-{last}")
        draft.ask = Checkpoint(world.members, number, path, last, export)
    return False


def _next_epoch(draft: Draft) -> int:
    world = draft.record.world
    return max(draft.record.last_epoch, world.epoch if world else -1) + 1


def _backing_off(draft: Draft) -> bool:
    return draft.now < draft.record.retry_after


def _checkpoint_if_due(draft: Draft, world: World) -> None:
    """Ask for the next periodic checkpoint (every `checkpoint.everySteps`) and, with
    `checkpoint.exportTo`, for one of the last step, exported once saved."""
    spec = draft.job.spec
    every, last = spec.checkpoint_every, spec.training.steps
    if not spec.checkpoint_path or not (every or spec.export_to):
        return
    speaker = draft.seen.pods.get(world.members[0])
    if speaker is None or speaker.agent is None:
        return
    number = speaker.agent.step // every + 1 if every else 1
    if draft.record.checkpoint_asked >= number:
        return
    at_step = number * every if every else last
    if spec.export_to and at_step >= last:
        at_step = last
    export_to = spec.export_to if at_step == last and spec.export_to else ""
    path = _checkpoint_dir(draft, f"step-{at_step}")
    draft.ask = Checkpoint(world.members, number, path, at_step, export_to)


def _checkpoint_dir(draft: Draft, name: str) -> str:
    """A checkpoint's directory under spec.checkpoint.path."""
    return f"{(draft.job.spec.checkpoint_path or '').rstrip('/')}/{name}"


def _note_failed_checkpoint(draft: Draft) -> None:
    """A checkpoint the agents report failed, seen for the first time: a Warning event naming
    the reason (the status keeps it, and the Degraded condition says it, until one is saved).
    It is not asked again: the next checkpoint is, at its period."""
    failed = checkpoints.newly_failed(draft.job, draft.seen, draft.now)
    if failed is not None:
        draft.after.append(Event(EventType.WARNING, "CheckpointFailed", failed.describe()))


def _restore(draft: Draft, why: str) -> None:
    """Start a new first world from the last checkpoint saved (as an agent reports it, or as the
    status kept it when no agent that saved it is left), with every ready pod that is standing
    by or whose world broke; Failed when none was saved."""
    spec, model = draft.job.spec, draft.job.model
    last = checkpoints.last_saved(draft.job, draft.seen, draft.now)
    if last is None:
        message = f"{why}; no checkpoint was saved, so the job cannot go on"
        draft.failure = Failure("NoCopyNoCheckpoint", message)
        return
    ready = [p.name for p in draft.seen.live()
             if p.ready and p.agent is not None and p.agent.phase in _RESTARTABLE]  # fmt: skip
    draft.keep_pods(spec.replicas, set(ready))
    try:
        choice = policy.choose(model, spec, min(spec.replicas, len(ready)))
    except InvalidInput as err:
        draft.message = f"restoring {last.path}: {err}"
        return
    picked = policy.pick(choice.degrees, ready, choice.used, draft.seen.nodes(),
                         draft.seen.pod_of())  # fmt: skip
    layout = choice.degrees.layout(model, picked)
    _begin(draft, InFlight(
        epoch=_next_epoch(draft), new=World.of(0, layout), store=_NO_STORE, started=draft.now,
        reason=f"restore from {last.path} (step {last.step}): {why}", restore=last.path,
    ), restores=True)  # fmt: skip


def _begin(draft: Draft, plan: InFlight, restores: bool = False) -> None:
    """Ask a member that stays through the change to host the epoch's store; `hosted` then
    records the reconfiguration and asks every member of either layout to prepare it."""
    plan = replace(plan, new=World.of(plan.epoch, plan.new.layout(draft.job.model)))
    stays = [m for m in plan.new.members if plan.old is None or m in plan.old.members]
    pod_of = draft.seen.pod_of()  # recorded with the change: each member is told the same
    plan = replace(plan, pods=tuple((m, pod_of[m]) for m in plan.union() if m in pod_of))
    draft.ask = Begin((stays or list(plan.new.members))[0], plan, restores)
