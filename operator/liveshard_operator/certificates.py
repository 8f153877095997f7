"""A job's certificates as the operator keeps them: its two TLS Secrets (`<job>-operator-tls`, the
CA's key and the operator's client pair; `<job>-agent-tls`, what every worker gets), issued once,
renewed when due, the CA rotated when due or asked, and the workers' serving pair sent to every
agent that serves another (`RotateCertificate`). `pki` issues and parses; this module reads and
patches the Secrets and calls the agents, and decides each step of a rotation from what the
Secrets hold, so that a pass cut anywhere resumes where it was.

With cert-manager (`liveshard-operator --cert-manager`) the operator issues nothing: it creates
the job's Issuers and Certificates (`render.cert_manager_objects`) and reads the same two Secrets
once cert-manager wrote them; renewals are cert-manager's, and each renewed serving pair is sent
to the agents as the operator's own are.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any

from . import pki, render
from .agents import AgentClient, AgentError, ClientTls, fan_out
from .kube import ApiError, Events, Kube
from .observation import Observation

log = logging.getLogger(__name__)


class CertificatesPending(Exception):
    """The job's certificates are not there yet (cert-manager has not issued them, or is not
    installed); the message says which and what to do."""


class Certificates:
    """The certificates of one job; `clients` holds its agents' clients (by pod), as `observe`
    keeps them."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        events: Events,
        clients: dict[str, AgentClient],
        cert_manager: bool = False,
        issuer: render.IssuerRef | None = None,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.events, self.clients = events, clients
        self.cert_manager = cert_manager  # cert-manager issues the job's certificates
        self.issuer = issuer  # of the user's, which issues them (None: the job's own CA)
        self.serving: pki.Pair | None = None  # the workers' serving pair, as `ensure` read it
        self.serving_ca = b""  # and the CA certificates their Secret trusts
        self._client_tls: ClientTls | None = None  # the operator's side, as `ensure` read it
        # Whether a Secret was patched since `ensure` last read them (`rotate` moves a CA
        # rotation on): the next pass must read them again.
        self.patched = False

    def ensure(self, job: dict[str, Any]) -> None:
        """The job's CA and certificates: issued once (the operator's Secret first, as it holds
        the CA's key; then the workers' from that CA; another replica's Secret, created first, is
        the one kept), then renewed from the same CA when due (`pki.renewal_due`). The CA itself
        is rotated when due (`pki.CA_RENEW_BEFORE`) or asked (the job's `ROTATE_CA` annotation
        takes a value not handled yet): a new CA is trusted beside the old one until every agent
        serves a certificate of it (`rotate`). The workers' Secret trusts what the
        operator's does, and its pair is issued again whenever that changes. With cert-manager,
        `_issued_by_cert_manager` instead."""
        if self.cert_manager:
            self._issued_by_cert_manager(job)
            return
        operator_name = render.operator_tls_name(self.name)

        def first_authority() -> dict[str, Any]:
            ca = pki.new_authority()
            pair = pki.operator_pair(ca)
            log.info("job %s: issuing its CA and the operator's certificate", self.name)
            return render.operator_tls_secret(job, ca.cert, ca.key, pair.cert, pair.key)

        secret = self._tls_secret(operator_name, first_authority)
        data = _decoded(secret)
        trusted = pki.certificates(data[render.CA_CERT])
        ca = pki.Authority(trusted[0], data[render.CA_KEY])
        if len(trusted) == 1:
            why = self._ca_rotation_asked(job, ca, secret)
            if why:
                ca = pki.new_authority()
                data = self._patch(job, operator_name, "CARotationStarted", (
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

        agent = _decoded(self._tls_secret(agent_name, first_serving))
        if agent[render.CA_CERT] != data[render.CA_CERT]:  # the CA rotates
            serving = pki.serving_pair(ca, self.name, self.namespace)
            agent = self._patch(job, agent_name, "", "", {
                render.CA_CERT: data[render.CA_CERT], render.TLS_CERT: serving.cert,
                render.TLS_KEY: serving.key,
            })  # fmt: skip
        elif pki.renewal_due(agent[render.TLS_CERT]):
            serving = pki.serving_pair(ca, self.name, self.namespace)
            agent = self._renew(job, agent_name, serving, "the workers' serving")
        self.serving = pki.Pair(agent[render.TLS_CERT], agent[render.TLS_KEY])
        self.serving_ca = agent[render.CA_CERT]

    def _issued_by_cert_manager(self, job: dict[str, Any]) -> None:
        """The job's cert-manager objects, created when missing, and the two Secrets cert-manager
        issues from them, read. CertificatesPending while a Secret is not issued yet, unless an
        earlier pass read both (the pass then goes on with those); or when the cluster serves no
        cert-manager.io/v1 kinds."""
        for resource, obj in render.cert_manager_objects(job, self.issuer):
            if self.kube.get(self.namespace, resource, obj["metadata"]["name"]) is not None:
                continue
            try:
                self.kube.create(self.namespace, resource, obj)
            except ApiError as err:  # 404 on a collection: the cluster has no such kind
                if err.status == 404:
                    raise CertificatesPending(
                        f"the operator issues certificates with cert-manager (--cert-manager), "
                        f"but the cluster serves no {obj['apiVersion']} {obj['kind']}: install "
                        "cert-manager"
                    ) from None
                if err.status != 409:  # 409: another replica's pass created it
                    raise
        found = {}
        issuer = self.issuer or render.IssuerRef(render.ca_name(self.name))
        for name in (render.agent_tls_name(self.name), render.operator_tls_name(self.name)):
            secret = self.kube.get(self.namespace, "secrets", name)
            data = _decoded(secret) if secret is not None else {}
            if not {render.CA_CERT, render.TLS_CERT, render.TLS_KEY} <= set(data):
                if self.serving is not None:
                    log.warning("job %s: Secret %s is not issued; using the last read", self.name,
                                name)  # fmt: skip
                    return
                if {render.TLS_CERT, render.TLS_KEY} <= set(data):
                    raise CertificatesPending(
                        f"Secret {name} was issued without {render.CA_CERT}: the agents and the "
                        f"operator trust only the issuer's CA, so {issuer} must be one that gives "
                        "it (a CA, Vault or self-signed issuer)"
                    )
                raise CertificatesPending(
                    f"waiting for cert-manager to issue Secret {name} (Certificate {name} of "
                    f"{issuer}; kubectl describe certificate {name})"
                )
            if secret is not None and not (secret["metadata"].get("ownerReferences") or []):
                # cert-manager's Secrets outlive their Certificate: the job owns them, as its own.
                owned = {"metadata": {"ownerReferences": [render.owner(job)]}}
                self.kube.patch(self.namespace, "secrets", name, owned)
            found[name] = data
        agent = found[render.agent_tls_name(self.name)]
        self.serving = pki.Pair(agent[render.TLS_CERT], agent[render.TLS_KEY])
        self.serving_ca = agent[render.CA_CERT]
        client = self._client_of(found[render.operator_tls_name(self.name)])
        if client != self._client_tls:  # new, or renewed: the clients are made again
            self._client_tls = client

    def _ca_rotation_asked(
        self, job: dict[str, Any], ca: pki.Authority, secret: dict[str, Any]
    ) -> str:
        """Why the CA `ca` is to be rotated now ("": it is not); `secret`, the operator's, says
        which value of the annotation was handled last."""
        if pki.renewal_due(ca.cert, before=pki.CA_RENEW_BEFORE):
            return "it ends within a year"
        asked = render.annotation(job, render.ROTATE_CA)
        if not asked:
            return ""
        handled = render.annotation(secret, render.ROTATED_FOR)
        return f"asked by the annotation {render.ROTATE_CA}={asked}" if asked != handled else ""

    def _tls_secret(self, name: str, first: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Secret `name`, created from `first()` when missing (another replica's, created
        meanwhile, is the one kept)."""
        secret = self.kube.get(self.namespace, "secrets", name)
        if secret is None:
            self._create_secret(first())
            return self._secret(name)
        return secret

    def _renew(
        self, job: dict[str, Any], secret: str, pair: pki.Pair, whose: str
    ) -> dict[str, bytes]:
        """Put `pair` in `secret` in place of the pair that is due; its data after."""
        return self._patch(
            job, secret, "CertificateRenewed",
            f"renewed {whose} certificate from the job's CA (Secret {secret})",
            {render.TLS_CERT: pair.cert, render.TLS_KEY: pair.key},
        )  # fmt: skip

    def _patch(
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
        self.patched = True
        if reason:
            log.info("job %s: %s", self.name, message)
            try:
                self.events(job, "Normal", reason, message)
            except Exception as err:  # an event is worth a log line, never a failed pass
                log.warning("job %s: posting event %s: %s", self.name, reason, err)
        return self._secret_data(secret)

    def rotate(self, job: dict[str, Any], seen: Observation) -> None:
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

        fan_out(rotate, stale)
        silent = [p for p in seen.pods.values() if p.ip and not p.gone and p.agent is None]
        if stale or silent or len(pki.certificates(trusted)) == 1:
            return
        operator_name = render.operator_tls_name(self.name)
        data = self._secret_data(operator_name)
        ca = pki.Authority(pki.certificates(data[render.CA_CERT])[0], data[render.CA_KEY])
        if not pki.issued_by(data[render.TLS_CERT], ca.cert):
            self._renew(job, operator_name, pki.operator_pair(ca), "the operator's client")
        else:
            self._patch(job, operator_name, "CARotated", (
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

    def _secret(self, name: str) -> dict[str, Any]:
        secret = self.kube.get(self.namespace, "secrets", name)
        if secret is None:
            raise ApiError("GET", f"secrets/{name}", 404, "the job's Secret is gone")
        return secret

    def _secret_data(self, name: str) -> dict[str, bytes]:
        return _decoded(self._secret(name))

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


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}
