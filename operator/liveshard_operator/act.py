"""The executor of a job's decisions: the only place a pass changes anything, through the API
server (`Kube`) and the agents (`AgentClient`), in the order a `Decision` says:

1. `before`: abort requests, a finished job's releases and deletions;
2. its ask: the store hosted (then the decision that begins the reconfiguration, or says why it
   could not), or the checkpoint requested of every member (recorded only if all took it);
3. the job's status, written once, in one merge patch: the record and what the pass reports;
4. `after`: Prepare (never before the reconfiguration is recorded in flight), releases,
   deletions, new pods, labels, events.

A refused agent call is logged and the pass goes on (the next pass sees its effect or its
absence); a failed API request ends the pass (the daemon retries it). Nothing is decided here.
The job's TLS Secrets are kept by `certificates.Certificates`, which the executor holds.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar, assert_never

import grpc

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput

from . import render
from .actions import (
    AbortOn,
    Action,
    Begin,
    Checkpoint,
    CommitOn,
    CreatePod,
    DeletePod,
    Event,
    LabelPod,
    Prepare,
    ReleaseMember,
)
from .agents import FAN_OUT, AgentClient, AgentError, fan_out, prepare_request
from .certificates import Certificates
from .decision import Decision, checkpointed, hosted, not_hosted, overtaken
from .kube import ApiError, Events, Kube
from .spec import JobSpec

log = logging.getLogger(__name__)
# Seconds a pass trusts the last check of the job's own objects (`Executor.ensure_objects`)
# while the job's spec and CA-rotation annotation stay as they were: in between, a pass asks the
# API server nothing about them.
RECHECK = 10.0
# The actions of a decision's `after` that go to agents, which the executor sends at once.
_AGENT_CALLS = (Prepare, ReleaseMember, CommitOn)
T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    """What the operator's flags ask of every job."""

    cert_manager: bool = False  # cert-manager issues its certificates (`certificates`)
    # The user's issuer of them (None: each job's own CA, under cert-manager).
    cert_manager_issuer: render.IssuerRef | None = None
    # Who else may reach its workers, for its NetworkPolicy (`render.network_policy`); None: the
    # operator makes none.
    isolation: render.Isolation | None = None


DEFAULTS = Options()


class Executor:
    """Carries out the decisions of one job; `clients` holds its agents' clients (by pod), as
    `observe` keeps them."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        events: Events,
        clients: dict[str, AgentClient],
        options: Options = DEFAULTS,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.events, self.clients, self.options = events, clients, options
        self.certificates = Certificates(
            kube, namespace, name, events, clients, options.cert_manager,
            options.cert_manager_issuer,
        )  # fmt: skip
        # What the last check of the job's objects was made for, and when (`ensure_objects`).
        self._checked: tuple[Any, ...] | None = None
        self._checked_at = 0.0
        self._token: str | None = None

    def ensure_objects(self, job: dict[str, Any], spec: JobSpec) -> None:
        """The job's token and TLS Secrets (or cert-manager's objects), PodDisruptionBudget,
        NetworkPolicy (with `options.isolation`; kept up to date) and (gang scheduled) PodGroup,
        created when missing, and the certificates renewed when due. InvalidInput when the job
        asks for gang scheduling and the cluster has no PodGroup kind; CertificatesPending while
        cert-manager has not issued its Secrets. Checked once every `RECHECK` seconds, and at
        once when the job (its uid), its spec (generation) or the CA rotation it asks for
        changed, or a Secret was patched since: an object deleted or edited by hand is so put
        back within that time."""
        metadata = job["metadata"]
        key = (metadata.get("uid"), metadata.get("generation"),
               render.annotation(job, render.ROTATE_CA))  # fmt: skip
        now = time.monotonic()
        fresh = now < self._checked_at + RECHECK and not self.certificates.patched
        if fresh and self._checked == key:
            return
        self._checked, self._token = None, None
        self.certificates.patched = False
        self._ensure_objects(job, spec)
        self._checked, self._checked_at = key, now

    def recheck(self) -> None:
        """The next pass checks the job's objects, however recent the last check."""
        self._checked = None

    def _ensure_objects(self, job: dict[str, Any], spec: JobSpec) -> None:
        if self.kube.get(self.namespace, "secrets", render.secret_name(self.name)) is None:
            self.kube.create(self.namespace, "secrets", render.token_secret(job))
        self.certificates.ensure(job)
        if self.kube.get(self.namespace, "poddisruptionbudgets", self.name) is None:
            self.kube.create(self.namespace, "poddisruptionbudgets", render.disruption_budget(job))
        if self.options.isolation:
            self._network_policy(render.network_policy(job, spec, self.options.isolation))
        groups = render.pod_group_resource(spec)
        if spec.gang and self.kube.get(self.namespace, groups, self.name) is None:
            group = render.pod_group(job, spec)
            try:
                self.kube.create(self.namespace, groups, group)
            except ApiError as err:  # 404 on a collection: the cluster has no such kind
                if err.status != 404:
                    raise
                which = "Volcano" if render.volcano(spec) else "the scheduler-plugins"
                raise InvalidInput(
                    f"spec.scheduling.gang: the cluster serves no PodGroup "
                    f"({group['apiVersion']}): install {which} CRDs"
                ) from None

    def _network_policy(self, policy: dict[str, Any]) -> None:
        """The job's NetworkPolicy: created when missing, its rules put back when they differ
        (the job's port edited, the operator upgraded with other peers)."""
        found = self.kube.get(self.namespace, "networkpolicies", self.name)
        if found is None:
            self.kube.create(self.namespace, "networkpolicies", policy)
        elif found.get("spec") != policy["spec"]:
            log.info("job %s: its NetworkPolicy's rules are out of date: put back", self.name)
            try:
                self.kube.patch(
                    self.namespace, "networkpolicies", self.name, {"spec": policy["spec"]}
                )
            except ApiError as err:  # a grant missing is worth a log line, not the pass
                log.warning("job %s: putting its NetworkPolicy back: %s", self.name, err)

    def token(self) -> str:
        """The job's token, which every agent call carries (read again after each check of the
        job's objects)."""
        if self._token is None:
            secret = self.kube.get(self.namespace, "secrets", render.secret_name(self.name))
            assert secret is not None  # ensure_objects created it
            self._token = base64.b64decode(secret["data"][render.TOKEN_KEY]).decode()
        return self._token

    # The job's resourceVersion as the pass read it (the controller sets it): the status is
    # written over that version only, and a job changed since ends the pass (`kube.Stale`).
    observed: str | None = None
    # The job's version that the last pass's write made when that write is no news to the
    # job's loop, whose watch event then wakes nothing: it left a reconfiguration in flight (the
    # wait follows a member of it, `sentinel`, and wakes when that member has news), or it
    # changed only the training's progress (`Decision.news`: the step moves all the time).
    quiet: str | None = None
    # Whether a Prepare or a commit the pass sent failed where the agent may answer later
    # (unavailable, deadline exceeded): the next pass sends it again, after `RESEND` (the
    # controller clears it as a pass begins).
    unsent: bool = False
    # The last Prepare's request, made once for all its members (`_prepare`).
    _made: tuple[Prepare, pb.PrepareRequest] | None = None

    def write(self, status: dict[str, Any]) -> str:
        """Write the pass's status; the job's version after it."""
        return self.kube.patch_job_status(self.namespace, self.name, status, self.observed)

    def run(self, decision: Decision) -> Decision:
        """Carry out `decision` (see the module's docstring for the order); the decision carried
        out (a reconfiguration's begin recorded once its store is hosted)."""
        overtaking = self._aborts(decision)
        if overtaking:
            decision = overtaken(decision, *overtaking[0])
        for action in decision.before:
            if not isinstance(action, AbortOn):
                self._do(decision, action)
        decision = self._answer(decision)
        written = self.write(decision.status)
        self.quiet = written if decision.record.in_flight is not None or not decision.news else None
        # An agent call each, but one a pod for the members of a pod of several that are told
        # the same (the action but for its member).
        commands = [a for a in decision.after if isinstance(a, _AGENT_CALLS)]
        pods = by_pod(commands, lambda a: (replace(a, member=""), decision.seen.pod_name(a.member)))
        fan_out(self._command, pods, max(map(len, pods), default=1))
        for action in decision.after:
            if not isinstance(action, _AGENT_CALLS):
                self._do(decision, action)
        return decision

    def _answer(self, decision: Decision) -> Decision:
        ask = decision.ask
        if isinstance(ask, Begin):
            plan = ask.plan
            try:
                store = self.clients[ask.host].host_store(plan.epoch)
            except (AgentError, KeyError) as err:
                return not_hosted(decision, str(err))
            log.info("job %s: epoch %s: %s", self.name, plan.epoch, plan.reason)
            return hosted(decision, store)
        if isinstance(ask, Checkpoint):

            def send(client: AgentClient, names: list[str]) -> None:
                client.checkpoint(ask.number, ask.path, ask.at_step, ask.export_to, names)

            def take(members: list[str]) -> bool:
                return not self._to_pod(members, f"checkpoint {ask.number}", send)

            pods = by_pod(ask.members, decision.seen.pod_name)
            taken = all(fan_out(take, pods, max(map(len, pods), default=1)))
            return checkpointed(decision, taken=taken)
        return decision

    def _do(self, decision: Decision, action: Action) -> None:
        match action:
            case CreatePod(pod=pod):
                self.kube.create(self.namespace, "pods", pod)
            case DeletePod(pod=pod, because=because):
                if because:
                    log.warning("job %s: deleting %s: %s", self.name, pod, because)
                self.kube.delete(self.namespace, "pods", pod)
            case ReleaseMember() | CommitOn() | Prepare():
                self._command([action])
            case LabelPod(pod=pod, role=role):
                labels = {"metadata": {"labels": {render.ROLE_LABEL: role}}}
                self.kube.patch(self.namespace, "pods", pod, labels)
            case AbortOn():
                self._abort([action], wait=True)
            case Event():
                self._post(decision, action)
            case _:
                assert_never(action)

    def _aborts(self, decision: Decision) -> list[tuple[str, str]]:
        """Send the decision's aborts; (member, why) for each member of the change given up that
        answered ABORTED: the epoch is in effect there (the commit came first, everywhere: that
        undoes the pass's abort; one of an epoch given up before, `decide`, undoes nothing).
        One member's drop decides for all (it records the epoch's decision), so only FAN_OUT of
        the change's members are waited for, a call each, until they took the drop at their
        next step boundary; the others are asked to queue it, a call a pod: a change of many
        members is given up in one round of step boundaries, not one for every FAN_OUT."""
        aborts = [a for a in decision.before if isinstance(a, AbortOn)]
        given_up = decision.unaborted.in_flight if decision.unaborted is not None else None
        epoch = given_up.epoch if given_up is not None else None
        waited = [a for a in aborts if a.epoch == epoch][:FAN_OUT]
        kept = set(waited)
        queued = by_pod([a for a in aborts if a not in kept],
                        lambda a: (a.epoch, decision.seen.pod_name(a.member)))  # fmt: skip
        answers = fan_out(lambda a: self._abort([a], wait=True), waited)
        answers += fan_out(
            partial(self._abort, wait=False), queued, max(map(len, queued), default=1)
        )
        groups = [[a] for a in waited] + queued
        return [
            answer for group, found in zip(groups, answers, strict=True)
            if group[0].epoch == epoch for answer in found
        ]  # fmt: skip

    def _abort(self, aborts: list[AbortOn], wait: bool) -> list[tuple[str, str]]:
        """Abort one epoch on members of one pod (`wait`: until each dropped it, else once it is
        queued there); (member, why) for each that answered ABORTED."""
        epoch = aborts[0].epoch
        members = [a.member for a in aborts if a.member in self.clients]  # else it never answered
        if not members:
            return []
        what = f"aborting epoch {epoch}" if wait else f"queueing the abort of epoch {epoch}"
        failed = self._to_pod(members, what, partial(_abort, epoch=epoch, wait=wait))
        return [
            (err.member, err.details) for err in failed
            if isinstance(err, AgentError) and err.code is grpc.StatusCode.ABORTED
        ]  # fmt: skip

    def _command(self, actions: list[ReleaseMember | CommitOn | Prepare]) -> None:
        """One kind of agent call, the same but for its member, to members of one pod."""
        members = [a.member for a in actions]
        match actions[0]:
            case Prepare():
                self._prepare(actions)  # type: ignore[arg-type]
            case ReleaseMember(saved=saved):
                members = [m for m in members if m in self.clients]  # else it never answered
                if members:  # not sent again: the member is gone from the job's world
                    self._to_pod(members, "release", partial(_release, saved=saved))
            case CommitOn(epoch=epoch):
                what = f"telling that epoch {epoch} committed"
                for err in self._to_pod(members, what, partial(_commit, epoch=epoch)):
                    self._failed(err)  # told again on the next pass

    def _prepare(self, prepares: list[Prepare]) -> None:
        """One reconfiguration's Prepare to members of one pod (`_to_pod`)."""
        # A reconfiguration's Prepares differ only in their member: the request is made once
        # (made for each of 1024 members, they cost the operator 0.36 s of CPU).
        first = prepares[0]
        key = replace(first, member="")
        made = self._made
        if made is None or made[0] != key:
            made = self._made = (key, prepare_request(key))
        request = made[1]

        def send(client: AgentClient, names: list[str]) -> None:
            client.prepare(request, names)

        members = [p.member for p in prepares]
        for err in self._to_pod(members, f"epoch {first.epoch}: prepare", send):
            self._failed(err)

    def _to_pod(
        self, members: list[str], what: str, send: Callable[[AgentClient, list[str]], None]
    ) -> list[Exception]:
        """`send` a command to `members`, of one pod: in one call naming them all when several
        (the pod's proxy passes it on to each); where that call fails for good (a member
        refused it, or the proxy is of a version that takes one member a call), in a call of
        its own to each, so that each says how it ended. The failures, each logged (none: every
        member took it)."""
        if len(members) > 1:
            try:
                send(self.clients[members[0]], members)
                return []
            except (AgentError, KeyError) as err:
                if not isinstance(err, AgentError) or err.retryable:
                    log.warning("job %s: %s: %s", self.name, what, err)
                    return [err]
                log.info("job %s: %s, one call a member: %s", self.name, what, err)
        failed: list[Exception] = []
        for member in members:
            try:
                send(self.clients[member], [])
            except (AgentError, KeyError) as err:
                log.warning("job %s: %s on %s: %s", self.name, what, member, err)
                failed.append(err)
        return failed

    def _failed(self, err: Exception) -> None:
        if isinstance(err, AgentError) and err.retryable:
            self.unsent = True

    def _post(self, decision: Decision, event: Event) -> None:
        try:
            self.events(decision.job.body, event.type.value, event.reason, event.message)
        except Exception as err:  # an event is worth a log line, never a failed pass
            log.warning("job %s: posting event %s: %s", self.name, event.reason, err)


def _release(client: AgentClient, members: list[str], saved: int) -> None:
    client.release(saved, members=members)


def _commit(client: AgentClient, members: list[str], epoch: int) -> None:
    client.switch(epoch, 0, members)


def _abort(client: AgentClient, members: list[str], epoch: int, wait: bool) -> None:
    client.abort(epoch, wait, members)


def by_pod(items: Iterable[T], pod: Callable[[T], Hashable]) -> list[list[T]]:
    """`items` grouped by their `pod`, in the order of each group's first: a pod of several
    members takes a command for all of them in one call (its proxy passes it on to each)."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(pod(item), []).append(item)
    return list(groups.values())
