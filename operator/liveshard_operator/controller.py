"""The level-based reconcile loop of one job: observe, take the next idempotent step, record it.

Each pass compares what the job asks for (its spec: the replica count, the constraints) with what
is (the pods, what their agents say, the world and the reconfiguration in flight recorded in the
job's status) and does one thing:
- no world yet: create the pods, wait until their agents are ready (pre-warmed), choose a layout,
  have a member host the store, and ask every member to start the first world;
- a reconfiguration in flight: finish it when every new member trains in its epoch (release the
  members that left, delete their pods), or abort it everywhere when an agent reports an abort,
  a failed prepare, a pod vanishes or its deadline passes (then retry with backoff);
- otherwise: replace leaving or lost members at once (a drained node, a deleted pod: the pod's
  grace period is the budget; a pod that ended without notice took its state along, and its
  bytes come from surviving copies), follow the replica count (new pods pre-warm as standby
  first), and start a reconfiguration when the layout or the members must change;
- a recovery from a lost member that aborted (no surviving copy of some state, or survivors that
  stopped in different states) cannot succeed by retrying: the job starts a new first world from
  its last saved checkpoint with the pods it has (its step goes back to the checkpoint's), or is
  Failed when it saved none.
Everything the next pass needs is in the job's status, so a restarted operator resumes where the
last one stopped; handlers only wake this loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput
from liveshard_core.job import Result
from liveshard_core.vps.spec import ModelSpec

from . import conditions, policy, render
from .agents import AgentClient, AgentError, cause_of, result_of
from .kube import Kube
from .observe import Observation, Pod, observe
from .spec import JobSpec
from .world import InFlight, World

log = logging.getLogger(__name__)

Events = Callable[[dict[str, Any], str, str, str], None]  # (job, type, reason, message)

_TRAINING = (pb.AgentStatus.TRAINING, pb.AgentStatus.DONE)
_RESTARTABLE = (pb.AgentStatus.STANDBY, pb.AgentStatus.BROKEN)  # may join a restored first world
_MAX_BACKOFF = 120.0


def _agent(pod: Pod | None) -> pb.AgentStatus | None:
    return pod.agent if pod is not None else None


def _trains_in(agent: pb.AgentStatus | None, epoch: int) -> bool:
    return agent is not None and agent.epoch >= epoch and agent.phase in _TRAINING


def _broken(agent: pb.AgentStatus | None) -> bool:
    return agent is not None and agent.phase == pb.AgentStatus.BROKEN


def _gave_up(agent: pb.AgentStatus, epoch: int) -> bool:
    """Whether the agent aborted `epoch`'s switch or failed to prepare it."""
    switch, pending = agent.last_switch, agent.pending
    aborted = (
        agent.HasField("last_switch")
        and switch.epoch == epoch
        and result_of(switch) is Result.ABORTED
    )
    failed = agent.HasField("pending") and pending.epoch == epoch
    return aborted or (failed and pending.state == pb.Pending.FAILED)


def backoff(attempts: int) -> float:
    """Seconds before retrying after `attempts` aborted reconfigurations in a row."""
    return min(5.0 * 2.0 ** max(attempts - 1, 0), _MAX_BACKOFF)


@dataclass
class _Pass:
    """One reconcile pass: what it saw and the status it writes."""

    job: dict[str, Any]
    spec: JobSpec
    model: ModelSpec
    seen: Observation
    record: dict[str, Any]  # status.reconfiguration
    status: dict[str, Any] = field(default_factory=dict)  # the patch

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])

    @property
    def world(self) -> World | None:
        data = self.record.get("world")
        return World.from_dict(data) if data else None

    @property
    def in_flight(self) -> InFlight | None:
        data = self.record.get("inFlight")
        return InFlight.from_dict(data) if data else None


class JobController:
    """Reconciles one ElasticTrainingJob; `reconcile` is one pass."""

    def __init__(self, kube: Kube, namespace: str, name: str, events: Events) -> None:
        self.kube, self.namespace, self.name, self.events = kube, namespace, name, events
        self.clients: dict[str, AgentClient] = {}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()

    # ---- one pass ----

    def reconcile(self) -> bool:
        """One pass; False once the job is gone."""
        job = self.kube.get_job(self.namespace, self.name)
        if job is None:
            return False
        status = job.get("status") or {}
        generation = int(job["metadata"].get("generation", 0))
        conds = conditions.Conditions(status.get("conditions") or [], generation)
        if conds.terminal():
            return True
        try:
            spec = JobSpec.parse(job["spec"])
            model = spec.model_spec()
        except (InvalidInput, KeyError, TypeError, ValueError) as err:
            conds.set("Ready", False, "InvalidSpec", str(err))
            conds.set("Degraded", True, "InvalidSpec", str(err))
            self._write(job, {"phase": "Pending", "conditions": conds.items,
                              "observedGeneration": generation})  # fmt: skip
            return True
        self._ensure_objects(job)
        token = self._token()
        seen = observe(self.kube, self.namespace, self.name, token, spec.port, self.clients)
        step = _Pass(job, spec, model, seen, dict(status.get("reconfiguration") or {}))
        if step.in_flight is not None:
            self._progress(step, step.in_flight)
        elif step.world is None:
            self._start(step)
        else:
            self._steady(step, step.world)
        self._publish(step, conds, generation)
        return True

    def _write(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        self.kube.patch_job_status(self.namespace, job["metadata"]["name"], status)

    def _ensure_objects(self, job: dict[str, Any]) -> None:
        if self.kube.get(self.namespace, "secrets", render.secret_name(self.name)) is None:
            self.kube.create(self.namespace, "secrets", render.token_secret(job))
        if self.kube.get(self.namespace, "poddisruptionbudgets", self.name) is None:
            self.kube.create(self.namespace, "poddisruptionbudgets", render.disruption_budget(job))

    def _token(self) -> str:
        import base64

        secret = self.kube.get(self.namespace, "secrets", render.secret_name(self.name))
        assert secret is not None
        return base64.b64decode(secret["data"][render.TOKEN_KEY]).decode()

    def _client(self, member: str) -> AgentClient:
        return self.clients[member]

    # ---- pods ----

    def _keep_pods(self, step: _Pass, wanted: int, members: set[str]) -> None:
        """Create pods until `wanted` live ones exist; delete surplus standing-by pods."""
        live = step.seen.live()
        for _ in range(wanted - len(live)):
            self.kube.create(self.namespace, "pods", render.worker_pod(step.job, step.spec))
        surplus = [p for p in reversed(live) if p.name not in members][: max(len(live) - wanted, 0)]
        for pod in surplus:
            self._release(pod.name)
            self.kube.delete(self.namespace, "pods", pod.name)

    def _release(self, member: str) -> None:
        client = self.clients.get(member)
        if client is None:
            return
        try:
            client.release()
        except AgentError as err:
            log.info("job %s: releasing %s: %s", self.name, member, err)

    def _label(self, step: _Pass, members: set[str]) -> None:
        for pod in step.seen.pods.values():
            role = render.MEMBER if pod.name in members else render.STANDBY
            if pod.role != role and not pod.gone:
                self.kube.patch(
                    self.namespace,
                    "pods",
                    pod.name,
                    {"metadata": {"labels": {render.ROLE_LABEL: role}}},
                )

    # ---- the first world ----

    def _start(self, step: _Pass) -> None:
        wanted = step.spec.replicas
        self._keep_pods(step, wanted, set())
        ready = [p for p in step.seen.live() if p.standing_by]
        if wanted == 0 or len(ready) < wanted:
            step.status["message"] = f"waiting for {wanted} ready pods ({len(ready)} ready)"
            return
        if self._backing_off(step):
            return
        try:
            choice = policy.choose(step.model, step.spec, len(ready))
        except InvalidInput as err:
            step.status["message"] = str(err)
            return
        members = [p.name for p in ready[: choice.used]]
        layout = choice.degrees.layout(step.model, members)
        restore = step.spec.restore_from
        reason = f"start with {choice.why}" + (f", from {restore}" if restore else "")
        self._begin(step, InFlight(
            epoch=self._next_epoch(step), reason=reason, new=World.of(0, layout), store=("", 0),
            restore=restore,
        ))  # fmt: skip

    # ---- a world exists ----

    def _steady(self, step: _Pass, world: World) -> None:
        if step.record.get("restore"):
            self._restore(step, str(step.record["restore"]))
            return
        pods, members = step.seen.pods, list(world.members)
        if any(self._agent_done(pods.get(m)) for m in members):
            step.status["finished"] = True
            return
        lost = [m for m in members if m not in pods or pods[m].gone] + self._silent(step, members)
        leaving = [m for m in members if m in pods and pods[m].leaving and m not in lost]
        stayers = [m for m in members if m not in lost and m not in leaving]
        standby = [p for p in step.seen.live() if p.standing_by and p.name not in members]
        starting = [p for p in step.seen.live() if not p.ready and p.name not in members]
        wanted = step.spec.replicas
        self._keep_pods(step, wanted, set(members))
        self._label(step, set(members))
        for pod in step.seen.pods.values():  # a standing-by pod that must go holds no state
            if pod.leaving and pod.name not in members:
                self._release(pod.name)
        urgent = lost or leaving
        candidates = stayers + [p.name for p in standby]
        target = min(wanted, len(candidates))
        step.status["spares"] = [p.name for p in standby]
        if not urgent and starting and len(candidates) < wanted:
            step.status["message"] = f"pre-warming {len(starting)} pod(s)"
            return
        if target == 0:
            step.status["message"] = "no member can be kept: every member is leaving or lost"
            return
        try:
            choice = policy.choose(step.model, step.spec, target)
        except InvalidInput as err:
            step.status["message"] = str(err)
            return
        old = world.layout(step.model)
        joiners = [p.name for p in standby]
        new_members = policy.assign(step.model, old, choice.degrees, stayers, joiners)
        step.status["spares"] = [m for m in candidates if m not in new_members]
        if choice.degrees.layout(step.model, new_members) == old:
            if len(candidates) > choice.used:
                step.status["message"] = (
                    f"{len(candidates) - choice.used} pod(s) stand by as hot spares: no layout "
                    f"of {step.model.config.name} uses {len(candidates)} members ({choice.why})"
                )
            self._checkpoint_if_due(step, world)
            return
        if self._backing_off(step) and not urgent:
            return
        reasons = []
        if lost:
            reasons.append(f"lost {', '.join(lost)}")
        if leaving:
            reasons.append(f"evicting {', '.join(leaving)}")
        if len(new_members) != len(members) and not urgent:
            reasons.append(f"scale {len(members)} -> {len(new_members)}")
        layout = choice.degrees.layout(step.model, new_members)
        self._begin(step, InFlight(
            epoch=self._next_epoch(step), reason="; ".join(reasons) or "new layout",
            new=World.of(0, layout), store=("", 0), old=world, lost=tuple(lost),
        ))  # fmt: skip

    def _silent(self, step: _Pass, members: list[str]) -> list[str]:
        """Members whose agent has answered nothing for the op deadline while another's world
        broke: dead or hung, they hold up the others; their pods are deleted and they count as
        lost. When they were first seen silent is kept in the job's status."""
        pods = step.seen.pods
        broken = any(_broken(_agent(pods.get(m))) for m in members)
        silent = [m for m in members if broken and m in pods and not pods[m].gone
                  and pods[m].agent is None]  # fmt: skip
        now, recorded = time.time(), step.record.get("silent") or {}
        since = {m: float(t) for m, t in recorded.items() if m in silent}
        since.update({m: now for m in silent if m not in since})
        if since != recorded:
            step.record["silent"] = since or None
            self._write(step.job, {"reconfiguration": step.record})
        out = [m for m in silent if now - since[m] >= step.spec.deadlines.op]
        for member in out:
            log.warning("job %s: %s answers nothing while its world is broken: %s", self.name,
                        member, pods[member].error)  # fmt: skip
            self.kube.delete(self.namespace, "pods", member)
        return out

    def _agent_done(self, pod: Pod | None) -> bool:
        return pod is not None and pod.agent is not None and pod.agent.phase == pb.AgentStatus.DONE

    def _next_epoch(self, step: _Pass) -> int:
        world = step.world
        return max(int(step.record.get("lastEpoch", -1)), world.epoch if world else -1) + 1

    def _backing_off(self, step: _Pass) -> bool:
        return time.time() < float(step.record.get("retryAfter", 0))

    # ---- a reconfiguration ----

    def _begin(self, step: _Pass, plan: InFlight) -> None:
        """Host the epoch's store on a member that stays through it, record the reconfiguration
        in status, then ask every member of either layout to prepare it."""
        new = World.of(plan.epoch, plan.new.layout(step.model))
        stays = [m for m in new.members if plan.old is None or m in plan.old.members]
        host = (stays or list(new.members))[0]
        try:
            address = self._client(host).host_store(plan.epoch)
        except (AgentError, KeyError) as err:
            step.status["message"] = f"epoch {plan.epoch}: hosting the store on {host}: {err}"
            return
        plan = InFlight(
            epoch=plan.epoch, reason=plan.reason, new=new, store=address, old=plan.old,
            lost=plan.lost, restore=plan.restore,
        )  # fmt: skip
        step.record.update(inFlight=plan.to_dict(), lastEpoch=plan.epoch)
        self._write(step.job, {"reconfiguration": step.record})
        before = plan.old.describe() if plan.old else "nothing"
        change = f"epoch {plan.epoch}: {plan.reason}: {before} -> {new.describe()}"
        self._event(step, "Normal", "Reconfiguring", change)
        log.info("job %s: epoch %s: %s", self.name, plan.epoch, plan.reason)
        self._ask_to_prepare(step, plan)

    def _ask_to_prepare(self, step: _Pass, plan: InFlight) -> None:
        """Send Prepare to every member of the change that has not taken it yet."""
        spec = step.spec
        deadlines = spec.deadlines
        old = plan.old.layout(step.model) if plan.old else None
        new = plan.new.layout(step.model)
        for member in plan.union():
            agent = _agent(step.seen.pods.get(member))
            if agent is None or _trains_in(agent, plan.epoch):
                continue
            if agent.HasField("pending") and agent.pending.epoch == plan.epoch:
                continue
            try:
                self._client(member).prepare(
                    epoch=plan.epoch, store=plan.store, to=new, old=old, lost=list(plan.lost),
                    budget=spec.budget_bytes, deadlines=deadlines, at_step=0,
                    restore_from=plan.restore,
                )  # fmt: skip
            except AgentError as err:
                log.warning(
                    "job %s: epoch %s: prepare on %s: %s", self.name, plan.epoch, member, err
                )

    def _progress(self, step: _Pass, plan: InFlight) -> None:
        pods = step.seen.pods
        union = plan.union()
        agents: dict[str, pb.AgentStatus] = {}
        for member in union:
            pod = pods.get(member)
            if pod is not None and pod.agent is not None:
                agents[member] = pod.agent
        trained = [m for m in plan.new.members if m in agents and _trains_in(agents[m], plan.epoch)]
        aborted = [m for m, a in agents.items() if _gave_up(a, plan.epoch)]
        vanished = [m for m in union if m not in pods or pods[m].gone]
        overdue = time.time() - plan.started > step.spec.deadlines.total + 60
        if len(trained) == len(plan.new.members):
            self._commit(step, plan, agents)
        elif trained and (aborted or vanished):
            self._split(step, plan, trained, aborted + vanished)
        elif aborted or vanished or overdue:
            why = (f"aborted by {', '.join(aborted)}" if aborted else
                   f"lost {', '.join(vanished)}" if vanished else "deadline passed")  # fmt: skip
            detail = next((agents[m].last_switch.reason or agents[m].pending.reason
                           for m in aborted), "")  # fmt: skip
            why = f"{why}: {detail}" if detail else why
            self._abort(step, plan, why, agents)
            causes = {cause_of(agents[m].last_switch) for m in aborted}
            # the same recovery would abort again
            if plan.lost and any(c is not None and c.permanent for c in causes):
                lost = ", ".join(plan.lost)
                step.record["restore"] = f"the recovery from the loss of {lost} {why}"
                self._write(step.job, {"reconfiguration": step.record})
        else:
            self._ask_to_prepare(step, plan)
            step.status["message"] = (
                f"epoch {plan.epoch}: {len(trained)}/{len(plan.new.members)} members switched"
            )

    def _commit(self, step: _Pass, plan: InFlight, agents: dict[str, pb.AgentStatus]) -> None:
        speaker = agents[plan.new.members[0]].last_switch
        last = {
            "epoch": plan.epoch, "reason": plan.reason,
            "from": plan.old.describe() if plan.old else "", "to": plan.new.describe(),
            "pauseSeconds": round(speaker.pause_seconds, 4) if plan.old else 0.0,
            "bytesMoved": int(speaker.network_bytes), "result": "committed",
            "message": speaker.reason or f"epoch {plan.epoch}: committed",
        }  # fmt: skip
        step.record.update(world=plan.new.to_dict(), inFlight=None, attempts=0, retryAfter=0)
        step.status["lastReconfiguration"] = last
        self._write(step.job, {"reconfiguration": step.record, "lastReconfiguration": last})
        self._event(step, "Normal", "Reconfigured",
                    f"epoch {plan.epoch} committed: {last['from'] or 'nothing'} -> {last['to']} "
                    f"({plan.reason}); pause {last['pauseSeconds']} s, "
                    f"{last['bytesMoved']} bytes moved")  # fmt: skip
        members = set(plan.new.members)
        self._label(step, members)
        left = [m for m in (plan.old.members if plan.old else ()) if m not in members]
        wanted = step.spec.replicas
        for member in left:
            pod = step.seen.pods.get(member)
            self._release(member)
            if pod is not None and not pod.leaving and len(step.seen.live()) > wanted:
                self.kube.delete(self.namespace, "pods", member)

    def _abort(
        self, step: _Pass, plan: InFlight, why: str, agents: dict[str, pb.AgentStatus]
    ) -> None:
        for member, agent in agents.items():
            if agent.HasField("pending") and agent.pending.epoch == plan.epoch:
                try:
                    self._client(member).abort(plan.epoch)
                except AgentError as err:
                    log.info(
                        "job %s: aborting epoch %s on %s: %s", self.name, plan.epoch, member, err
                    )
        attempts = int(step.record.get("attempts", 0)) + 1
        step.record.update(
            inFlight=None, attempts=attempts, retryAfter=time.time() + backoff(attempts)
        )
        last = {
            "epoch": plan.epoch, "reason": plan.reason,
            "from": plan.old.describe() if plan.old else "", "to": plan.new.describe(),
            "pauseSeconds": 0.0, "bytesMoved": 0, "result": "aborted", "message": why,
        }  # fmt: skip
        step.status["lastReconfiguration"] = last
        self._write(step.job, {"reconfiguration": step.record, "lastReconfiguration": last})
        self._event(step, "Warning", "ReconfigurationAborted",
                    f"epoch {plan.epoch} aborted ({plan.reason}): {why}; the job keeps its "
                    f"layout, retry in {backoff(attempts):.0f} s")  # fmt: skip

    def _restore(self, step: _Pass, why: str) -> None:
        """Start a new first world from the last checkpoint the members saved, with every ready
        pod that is standing by or whose world broke; Failed when none was saved."""
        pods = step.seen.pods.values()
        saved = [p.agent.last_checkpoint for p in pods
                 if p.agent is not None and p.agent.last_checkpoint.path]  # fmt: skip
        if not saved:
            step.status["failed"] = f"{why}; no checkpoint was saved, so the job cannot go on"
            step.status["failedReason"] = "NoCopyNoCheckpoint"
            return
        last = max(saved, key=lambda c: c.number)
        ready = [p.name for p in step.seen.live()
                 if p.ready and p.agent is not None and p.agent.phase in _RESTARTABLE]  # fmt: skip
        self._keep_pods(step, step.spec.replicas, set(ready))
        try:
            choice = policy.choose(step.model, step.spec, min(step.spec.replicas, len(ready)))
        except InvalidInput as err:
            step.status["message"] = f"restoring {last.path}: {err}"
            return
        layout = choice.degrees.layout(step.model, ready[: choice.used])
        step.record["restore"] = None
        self._begin(step, InFlight(
            epoch=self._next_epoch(step), new=World.of(0, layout), store=("", 0),
            reason=f"restore from {last.path} (step {last.step}): {why}", restore=last.path,
        ))  # fmt: skip

    def _split(self, step: _Pass, plan: InFlight, trained: list[str], failed: list[str]) -> None:
        """Some members committed and others did not (a member died during the vote): no world
        is whole. Only a checkpoint can bring the job back."""
        message = (
            f"epoch {plan.epoch}: members {trained} committed but {failed} did not (a member "
            "failed during the vote); restore the job from a checkpoint"
        )
        step.status["failed"] = message
        step.status["failedReason"] = "SplitReconfiguration"
        self._event(step, "Warning", "SplitReconfiguration", message)

    def _checkpoint_if_due(self, step: _Pass, world: World) -> None:
        spec = step.spec
        if not spec.checkpoint_every or not spec.checkpoint_path:
            return
        speaker = step.seen.pods.get(world.members[0])
        if speaker is None or speaker.agent is None:
            return
        number = speaker.agent.step // spec.checkpoint_every + 1
        if int(step.record.get("checkpointAsked", 0)) >= number:
            return
        at_step = number * spec.checkpoint_every
        path = f"{spec.checkpoint_path.rstrip('/')}/step-{at_step}"
        for member in world.members:
            try:
                self._client(member).checkpoint(number, path, at_step)
            except (AgentError, KeyError) as err:
                log.warning("job %s: checkpoint %s on %s: %s", self.name, number, member, err)
                return
        step.record["checkpointAsked"] = number
        self._write(step.job, {"reconfiguration": step.record})

    # ---- status ----

    def _event(self, step: _Pass, kind: str, reason: str, message: str) -> None:
        try:
            self.events(step.job, kind, reason, message)
        except Exception as err:  # an event is worth a log line, never a failed pass
            log.warning("job %s: posting event %s: %s", self.name, reason, err)

    def _publish(self, step: _Pass, conds: conditions.Conditions, generation: int) -> None:
        world = World.from_dict(step.record["world"]) if step.record.get("world") else None
        plan = InFlight.from_dict(step.record["inFlight"]) if step.record.get("inFlight") else None
        pods = step.seen.pods
        status: dict[str, Any] = {
            "observedGeneration": generation,
            "selector": render.selector(self.name),
            "replicas": len(world.members) if world else 0,
        }
        training: list[str] = []
        if world is not None:
            training = [m for m in world.members if _trains_in(_agent(pods.get(m)), world.epoch)]
            speaker = pods.get(world.members[0])
            if speaker is not None and speaker.agent is not None:
                status["step"] = int(speaker.agent.step)
                status["loss"] = round(float(speaker.agent.loss), 6)
            status.update(epoch=world.epoch, layout=world.describe(), members=list(world.members))
        status["readyReplicas"] = len(training)
        status["spares"] = step.status.get("spares", [])
        if "lastReconfiguration" in step.status:
            status["lastReconfiguration"] = step.status["lastReconfiguration"]
        message = step.status.get("message", "")
        last = step.status.get("lastReconfiguration") or {}
        if step.status.get("failed"):
            phase = "Failed"
            conds.set("Failed", True, step.status["failedReason"], step.status["failed"])
        elif step.status.get("finished"):
            phase = "Succeeded"
            conds.set("Succeeded", True, "Trained", f"trained {step.spec.training.steps} steps")
            self._finish(step)
        elif plan is not None:
            phase = "Reconfiguring"
        elif world is not None:
            phase = "Running"
        else:
            phase = "Pending"
        conds.set(
            "Ready", phase == "Running", phase, message or f"{len(training)} members training"
        )
        conds.set("Reconfiguring", plan is not None, "InFlight" if plan else "Idle",
                  f"epoch {plan.epoch}: {plan.reason}" if plan else "")  # fmt: skip
        if last.get("result") == "aborted":
            conds.set("Degraded", True, "ReconfigurationAborted", last.get("message", ""))
        elif status["spares"]:
            conds.set("Degraded", True, "HotSpares", message)
        else:
            conds.set("Degraded", False, "AsPlanned", message)
        status.update(phase=phase, conditions=conds.items)
        self._write(step.job, status)

    def _finish(self, step: _Pass) -> None:
        """The job trained its last step: release every agent and delete the pods."""
        for pod in step.seen.pods.values():
            self._release(pod.name)
            self.kube.delete(self.namespace, "pods", pod.name)
