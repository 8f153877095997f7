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
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, assert_never

import grpc

from liveshard_core.errors import InvalidInput

from . import pki, render
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
from .agents import AgentClient, AgentError, ClientTls
from .decision import Decision, checkpointed, hosted, not_hosted, overtaken
from .kube import ApiError, Kube
from .observation import Observation
from .spec import JobSpec

log = logging.getLogger(__name__)

FAN_OUT = 32  # agent calls of one pass in flight at once
T = TypeVar("T")

Events = Callable[[dict[str, Any], str, str, str], None]  # (job, type, reason, message)


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
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.events, self.clients = events, clients

    def ensure_objects(self, job: dict[str, Any], spec: JobSpec) -> None:
        """The job's token and TLS Secrets, PodDisruptionBudget and (gang scheduled) PodGroup,
        created when missing. InvalidInput when the job asks for gang scheduling and the cluster
        has no PodGroup kind."""
        if self.kube.get(self.namespace, "secrets", render.secret_name(self.name)) is None:
            self.kube.create(self.namespace, "secrets", render.token_secret(job))
        self.ensure_tls(job)
        if self.kube.get(self.namespace, "poddisruptionbudgets", self.name) is None:
            self.kube.create(self.namespace, "poddisruptionbudgets", render.disruption_budget(job))
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

    def ensure_tls(self, job: dict[str, Any]) -> None:
        """The job's CA and certificates: issued once (the operator's Secret first, as it holds
        the CA's key; then the workers' from that CA; another replica's Secret, created first, is
        the one kept), then renewed from the same CA when due (`pki.renewal_due`). The CA itself
        is rotated when due (`pki.CA_RENEW_BEFORE`) or asked (the job's `ROTATE_CA` annotation
        takes a value not handled yet): a new CA is trusted beside the old one until every agent
        serves a certificate of it (`rotate_certificates`). The workers' Secret trusts what the
        operator's does, and its pair is issued again whenever that changes."""
        operator_name = render.operator_tls_name(self.name)

        def first_authority() -> dict[str, Any]:
            ca = pki.new_authority()
            pair = pki.operator_pair(ca)
            log.info("job %s: issuing its CA and the operator's certificate", self.name)
            return render.operator_tls_secret(job, ca.cert, ca.key, pair.cert, pair.key)

        data = self._tls_secret(operator_name, first_authority)
        trusted = pki.certificates(data[render.CA_CERT])
        ca = pki.Authority(trusted[0], data[render.CA_KEY])
        if len(trusted) == 1:
            why = self._ca_rotation_asked(job, ca)
            if why:
                ca = pki.new_authority()
                data = self._put_tls(job, operator_name, "CARotationStarted", (
                    f"rotating the job's CA ({why}): the new one is trusted beside the old "
                    "until every agent serves a certificate of it"
                ), {render.CA_CERT: ca.cert + trusted[0], render.CA_KEY: ca.key},
                    {render.ROTATED_FOR: render.annotation(job, render.ROTATE_CA)})  # fmt: skip
        rotating = len(pki.certificates(data[render.CA_CERT])) > 1
        # While the CA rotates, the operator's pair is replaced once the agents trust the new CA.
        if pki.renewal_due(data[render.TLS_CERT]) and not rotating:
            data = self._renew(job, operator_name, pki.operator_pair(ca), "the operator's client")
        client = self._client_of(data)
        if client != self._client_tls:
            self._client_tls = client  # new, or renewed here or by a replica
        agent_name = render.agent_tls_name(self.name)

        def first_serving() -> dict[str, Any]:
            serving = pki.serving_pair(ca, self.name, self.namespace)
            return render.agent_tls_secret(job, data[render.CA_CERT], serving.cert, serving.key)

        agent = self._tls_secret(agent_name, first_serving)
        if agent[render.CA_CERT] != data[render.CA_CERT]:  # the CA rotates
            serving = pki.serving_pair(ca, self.name, self.namespace)
            agent = self._put_tls(job, agent_name, "", "", {
                render.CA_CERT: data[render.CA_CERT], render.TLS_CERT: serving.cert,
                render.TLS_KEY: serving.key,
            })  # fmt: skip
        elif pki.renewal_due(agent[render.TLS_CERT]):
            serving = pki.serving_pair(ca, self.name, self.namespace)
            agent = self._renew(job, agent_name, serving, "the workers' serving")
        self.serving = pki.Pair(agent[render.TLS_CERT], agent[render.TLS_KEY])
        self.serving_ca = agent[render.CA_CERT]

    def _ca_rotation_asked(self, job: dict[str, Any], ca: pki.Authority) -> str:
        """Why the CA `ca` is to be rotated now ("": it is not)."""
        if pki.renewal_due(ca.cert, before=pki.CA_RENEW_BEFORE):
            return "it ends within a year"
        asked = render.annotation(job, render.ROTATE_CA)
        if not asked:
            return ""
        secret = self.kube.get(self.namespace, "secrets", render.operator_tls_name(self.name))
        handled = render.annotation(secret or {}, render.ROTATED_FOR)
        return f"asked by the annotation {render.ROTATE_CA}={asked}" if asked != handled else ""

    def _tls_secret(self, name: str, first: Callable[[], dict[str, Any]]) -> dict[str, bytes]:
        """The data of Secret `name`, created from `first()` when missing (another replica's,
        created meanwhile, is the one kept)."""
        secret = self.kube.get(self.namespace, "secrets", name)
        if secret is None:
            self._create_secret(first())
            return self._secret_data(name)
        return _decoded(secret)

    def _renew(
        self, job: dict[str, Any], secret: str, pair: pki.Pair, whose: str
    ) -> dict[str, bytes]:
        """Put `pair` in `secret` in place of the pair that is due; its data after."""
        return self._put_tls(
            job, secret, "CertificateRenewed",
            f"renewed {whose} certificate from the job's CA (Secret {secret})",
            {render.TLS_CERT: pair.cert, render.TLS_KEY: pair.key},
        )  # fmt: skip

    def _put_tls(
        self,
        job: dict[str, Any],
        secret: str,
        reason: str,
        message: str,
        fields: dict[str, bytes],
        annotations: dict[str, str] | None = None,
    ) -> dict[str, bytes]:
        """Patch `fields` into the data of `secret` (and `annotations` on it); an event of
        `reason` with `message` when given. Returns the Secret's data after."""
        encoded = {k: base64.b64encode(v).decode() for k, v in fields.items()}
        patch: dict[str, Any] = {"data": encoded}
        if annotations:
            patch["metadata"] = {"annotations": annotations}
        self.kube.patch(self.namespace, "secrets", secret, patch)
        if reason:
            log.info("job %s: %s", self.name, message)
            try:
                self.events(job, "Normal", reason, message)
            except Exception as err:  # an event is worth a log line, never a failed pass
                log.warning("job %s: posting event %s: %s", self.name, reason, err)
        return self._secret_data(secret)

    serving: pki.Pair | None = None  # the workers' serving pair, as the last pass read it
    serving_ca: bytes = b""  # and the CA certificates their Secret trusts

    def rotate_certificates(self, job: dict[str, Any], seen: Observation) -> None:
        """Send the workers' serving pair and the CAs they trust to every agent that serves
        another pair (renewed, or issued by a rotated CA, after the agent started); one that
        cannot take it now is tried again next pass. A CA rotation goes on once every agent
        that answers serves the pair and none is silent: the operator's own certificate from
        the new CA first, then the old CA dropped from what both sides trust."""
        serving, trusted = self.serving, self.serving_ca
        if serving is None:
            return
        want = pki.fingerprint(serving.cert)
        stale = [
            name for name, pod in seen.pods.items()
            if pod.agent is not None and pod.agent.serving_certificate not in ("", want)
            and name in self.clients
        ]  # fmt: skip

        def rotate(name: str) -> None:
            try:
                self.clients[name].rotate_certificate(serving.cert, serving.key, trusted)
                log.info("job %s: agent %s serves the renewed certificate", self.name, name)
            except AgentError as err:
                log.warning("job %s: rotating %s's certificate: %s", self.name, name, err)

        self._fan_out(rotate, stale)
        silent = [p for p in seen.pods.values() if p.ip and not p.gone and p.agent is None]
        if stale or silent or len(pki.certificates(trusted)) == 1:
            return
        operator_name = render.operator_tls_name(self.name)
        data = self._secret_data(operator_name)
        ca = pki.Authority(pki.certificates(data[render.CA_CERT])[0], data[render.CA_KEY])
        if not pki.issued_by(data[render.TLS_CERT], ca.cert):
            self._renew(job, operator_name, pki.operator_pair(ca), "the operator's client")
        else:
            self._put_tls(job, operator_name, "CARotated", (
                "rotated the job's CA: every agent serves a certificate of the new one, and the "
                "old one is trusted no more"
            ), {render.CA_CERT: ca.cert})  # fmt: skip

    def _create_secret(self, secret: dict[str, Any]) -> bool:
        """Create `secret`; False when it exists already (another replica's pass)."""
        try:
            self.kube.create(self.namespace, "secrets", secret)
        except ApiError as err:
            if err.status != 409:
                raise
            return False
        return True

    def _secret_data(self, name: str) -> dict[str, bytes]:
        secret = self.kube.get(self.namespace, "secrets", name)
        if secret is None:
            raise ApiError("GET", f"secrets/{name}", 404, "the job's Secret is gone")
        return _decoded(secret)

    _client_tls: ClientTls | None = None  # as `ensure_tls` last read it

    def client_tls(self) -> ClientTls:
        """The operator's side of the job's mutual TLS, from its `<job>-operator-tls` Secret."""
        if self._client_tls is None:
            self._client_tls = self._client_of(
                self._secret_data(render.operator_tls_name(self.name))
            )
        return self._client_tls

    def _client_of(self, data: dict[str, bytes]) -> ClientTls:
        return ClientTls(
            ca=data[render.CA_CERT], cert=data[render.TLS_CERT], key=data[render.TLS_KEY],
            server_name=pki.server_name(self.name, self.namespace),
        )  # fmt: skip

    def token(self) -> str:
        """The job's token, which every agent call carries."""
        secret = self.kube.get(self.namespace, "secrets", render.secret_name(self.name))
        assert secret is not None  # ensure_objects created it
        return base64.b64decode(secret["data"][render.TOKEN_KEY]).decode()

    # The job's resourceVersion as the pass read it (the controller sets it): the status is
    # written over that version only, and a job changed since ends the pass (`kube.Stale`).
    observed: str | None = None

    def write(self, status: dict[str, Any]) -> None:
        self.kube.patch_job_status(self.namespace, self.name, status, self.observed)

    def run(self, decision: Decision) -> None:
        """Carry out `decision` (see the module's docstring for the order)."""
        aborts = [a for a in decision.before if isinstance(a, AbortOn)]
        overtaking = [r for r in self._fan_out(self._abort, aborts) if r is not None]
        if overtaking and decision.unaborted is not None:
            decision = overtaken(decision, *overtaking[0])
        for action in decision.before:
            if not isinstance(action, AbortOn):
                self._do(decision, action)
        decision = self._answer(decision)
        self.write(decision.status)
        calls = [a for a in decision.after if isinstance(a, Prepare | ReleaseMember | CommitOn)]
        self._fan_out(lambda action: self._do(decision, action), calls)
        for action in decision.after:
            if action not in calls:
                self._do(decision, action)

    def _fan_out(self, call: Callable[[Any], T], actions: list[Any]) -> list[T]:
        """`call` on every action at once, at most FAN_OUT at a time: a reconfiguration's agent
        calls cost the slowest agent's time, not the sum over members."""
        if len(actions) <= 1:
            return [call(a) for a in actions]
        with ThreadPoolExecutor(max_workers=min(FAN_OUT, len(actions))) as pool:
            return list(pool.map(call, actions))

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

            def take(member: str) -> bool:
                try:
                    self.clients[member].checkpoint(
                        ask.number, ask.path, ask.at_step, ask.export_to
                    )
                except (AgentError, KeyError) as err:
                    log.warning(
                        "job %s: checkpoint %s on %s: %s", self.name, ask.number, member, err
                    )
                    return False
                return True

            return checkpointed(decision, taken=all(self._fan_out(take, list(ask.members))))
        return decision

    def _do(self, decision: Decision, action: Action) -> None:
        match action:
            case CreatePod(pod=pod):
                self.kube.create(self.namespace, "pods", pod)
            case DeletePod(pod=pod, because=because):
                if because:
                    log.warning("job %s: deleting %s: %s", self.name, pod, because)
                self.kube.delete(self.namespace, "pods", pod)
            case ReleaseMember(member=member, saved=saved):
                self._release(member, saved)
            case LabelPod(pod=pod, role=role):
                labels = {"metadata": {"labels": {render.ROLE_LABEL: role}}}
                self.kube.patch(self.namespace, "pods", pod, labels)
            case Prepare():
                self._prepare(action)
            case AbortOn():
                self._abort(action)
            case CommitOn(member=member, epoch=epoch):
                try:
                    self.clients[member].switch(epoch, 0)
                except (AgentError, KeyError) as err:  # told again on the next pass
                    log.warning("job %s: telling %s that epoch %s committed: %s", self.name,
                                member, epoch, err)  # fmt: skip
            case Event():
                self._post(decision, action)
            case _:
                assert_never(action)

    def _abort(self, abort: AbortOn) -> tuple[str, str] | None:
        """Abort the epoch on one member; (member, why) when it answers ABORTED: the epoch is
        in effect there (the commit came first)."""
        try:
            self.clients[abort.member].abort(abort.epoch)
        except AgentError as err:
            log.info("job %s: aborting epoch %s on %s: %s", self.name, abort.epoch,
                     abort.member, err)  # fmt: skip
            if err.code is grpc.StatusCode.ABORTED:
                return abort.member, err.details
        except KeyError:
            pass  # no client: the agent never answered
        return None

    def _release(self, member: str, saved: int) -> None:
        client = self.clients.get(member)
        if client is None:  # never answered: nothing to release
            return
        try:
            client.release(saved)
        except AgentError as err:
            log.info("job %s: releasing %s: %s", self.name, member, err)

    def _prepare(self, prepare: Prepare) -> None:
        try:
            self.clients[prepare.member].prepare(
                epoch=prepare.epoch, store=prepare.store, to=prepare.to, old=prepare.old,
                lost=list(prepare.lost), budget=prepare.budget, deadlines=prepare.deadlines,
                at_step=0, restore_from=prepare.restore_from,
            )  # fmt: skip
        except AgentError as err:
            log.warning("job %s: epoch %s: prepare on %s: %s", self.name, prepare.epoch,
                        prepare.member, err)  # fmt: skip

    def _post(self, decision: Decision, event: Event) -> None:
        try:
            self.events(decision.job.body, event.type.value, event.reason, event.message)
        except Exception as err:  # an event is worth a log line, never a failed pass
            log.warning("job %s: posting event %s: %s", self.name, event.reason, err)


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}
