"""A job's certificates against the fake API server and agents of `test_act`: issued once,
renewed when due and sent to the agents that serve another pair; the CA rotated when asked or
due, step by step. tests/e2e/test_operator.py runs the same on the local cluster."""

from __future__ import annotations

import base64
import copy
import datetime
from typing import Any

import pytest
from liveshard_operator import act, pki, render
from liveshard_operator.act import Executor, Options
from liveshard_operator.certificates import Certificates
from liveshard_operator.controller import JobController
from liveshard_operator.kube import ApiError

from tests.operator.test_act import NOW_PLUS_A_YEAR, Calls, FakeAgent, FakeKube
from tests.operator.values import BODY, job, pod, seen, standby


def issued() -> tuple[Calls, FakeKube, Certificates]:
    """A job's certificates, issued; the calls and events go to the log."""
    calls: Calls = []
    kube = FakeKube(calls)
    certs = Certificates(kube, "ns", "tiny", lambda *a: calls.append(("event", a[2])), {})  # type: ignore[arg-type]
    certs.ensure(BODY)
    return calls, kube, certs


def judged_at(monkeypatch: pytest.MonkeyPatch, when: datetime.datetime) -> None:
    """Certificates' renewals are judged as at `when`."""
    due = pki.renewal_due
    monkeypatch.setattr(pki, "renewal_due", lambda cert, now=None, before=pki.RENEW_BEFORE: (
        due(cert, when, before)
    ))  # fmt: skip


def test_certificates_are_issued_once_renewed_when_due_and_sent_to_agents_serving_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls, kube, certs = issued()
    first = {name: dict(secret["data"]) for name, secret in kube.secrets.items()}
    assert set(first) == {"tiny-operator-tls", "tiny-agent-tls"}
    tls = certs.client_tls()
    certs.ensure(BODY)  # nothing due: nothing changes
    assert calls == [] and certs.client_tls() is tls
    assert certs.serving is not None
    old = pki.fingerprint(certs.serving.cert)
    # A year on, both certificates are due; the CA (ten years) is not.
    with monkeypatch.context() as patched:
        judged_at(patched, NOW_PLUS_A_YEAR)
        certs.ensure(BODY)
    assert [c for c in calls if c[0] == "renew"] == [
        ("renew", "tiny-operator-tls"),
        ("renew", "tiny-agent-tls"),
    ]
    assert [c for c in calls if c[0] == "event"] == [("event", "CertificateRenewed")] * 2
    for name, data in kube.secrets.items():
        assert data["data"]["ca.crt"] == first[name]["ca.crt"]  # the same CA
        assert data["data"]["tls.crt"] != first[name]["tls.crt"]
    renewed = certs.client_tls()
    assert renewed is not tls and renewed.cert != tls.cert and renewed.ca == tls.ca
    new = pki.fingerprint(certs.serving.cert)
    # Sent to the agents that serve another certificate, not to those that serve it already
    # nor to those in plaintext.
    calls.clear()
    certs.clients.update({m: FakeAgent(m, calls) for m in ("p0", "p1", "p2", "p3")})  # type: ignore[misc]
    served = {"p0": old, "p1": new, "p2": "", "p3": old}
    certs.rotate(BODY, seen(*(pod(m, standby(serving_certificate=f)) for m, f in served.items())))
    assert sorted(calls) == [("rotate", "p0", new, 1), ("rotate", "p3", new, 1)]


@pytest.mark.parametrize("checked_by", ["certificates", "executor"])
def test_the_ca_rotates_when_asked_or_due_trusting_both_until_every_agent_serves_the_new(
    monkeypatch: pytest.MonkeyPatch, checked_by: str
) -> None:
    calls, kube, certs = issued()
    ensure = certs.ensure
    if checked_by == "executor":  # a pass's check, trusted for long, due at once on a patch
        monkeypatch.setattr(act, "RECHECK", 3600.0)
        executor = Executor(kube, "ns", "tiny", lambda *a: calls.append(("event", a[2])), {})  # type: ignore[arg-type]
        certs = executor.certificates

        def ensure(body: dict[str, Any]) -> None:
            executor.ensure_objects(body, job().spec)

    def secret(name: str) -> dict[str, bytes]:
        return {k: base64.b64decode(v) for k, v in kube.secrets[f"tiny-{name}-tls"]["data"].items()}

    old_ca, first_client = secret("operator")["ca.crt"], secret("operator")["tls.crt"]
    certs.clients.update({m: FakeAgent(m, calls) for m in ("p0", "p1")})  # type: ignore[misc]

    def pass_with(*served: str, silent: bool = False) -> list[str]:
        """A pass over agents serving `served` (and a silent one): the events it posted."""
        calls.clear()
        ensure(annotated)
        pods = [pod(f"p{i}", standby(serving_certificate=f)) for i, f in enumerate(served)]
        certs.rotate(annotated, seen(*pods, *([pod("p9", None)] if silent else [])))
        return [c[1] if c[0] == "event" else c[0] for c in calls if c[0] in ("event", "rotate")]

    def serving() -> str:
        return pki.fingerprint(secret("agent")["tls.crt"])

    old = serving()
    annotated = copy.deepcopy(BODY)
    annotated["metadata"]["annotations"] = {render.ROTATE_CA: "2026-11-26"}
    # Asked: a new CA, trusted beside the old by both sides; the workers' pair from the new one;
    # the operator's pair stays the old CA's until every agent trusts the new.
    assert pass_with(old, old) == ["CARotationStarted", "rotate", "rotate"]
    trusted = pki.certificates(secret("operator")["ca.crt"])
    assert (
        len(trusted) == 2
        and trusted[1] == old_ca
        and secret("agent")["ca.crt"] == b"".join(trusted)
    )
    assert pki.issued_by(secret("agent")["tls.crt"], trusted[0])
    assert secret("operator")["tls.crt"] == first_client
    assert certs.client_tls().ca == b"".join(trusted)
    assert sorted(c for c in calls if c[0] == "rotate") == [
        ("rotate", f"p{i}", serving(), 2) for i in (0, 1)
    ]
    # Not before every agent serves it, and none is silent.
    new = serving()
    assert pass_with(new, old) == ["rotate"]
    assert pass_with(new, new, silent=True) == []
    assert secret("operator")["tls.crt"] == first_client
    # Then the operator's pair from the new CA, then the old CA dropped.
    assert pass_with(new, new) == ["CertificateRenewed"]
    assert pki.issued_by(secret("operator")["tls.crt"], trusted[0])
    assert pass_with(new, new) == ["CARotated"]
    assert secret("operator")["ca.crt"] == trusted[0]
    # The workers' Secret follows with a pair of the new CA alone, which the agents get.
    assert pass_with(new, new) == ["rotate", "rotate"]
    assert secret("agent")["ca.crt"] == trusted[0] and serving() not in (old, new)
    assert {c[3] for c in calls if c[0] == "rotate"} == {1}
    assert certs.client_tls().ca == trusted[0] and certs.client_tls().cert != first_client
    # Done: the same annotation asks nothing more.
    assert pass_with(serving(), serving()) == []
    assert len(pki.certificates(secret("operator")["ca.crt"])) == 1

    # A CA with less than a year left is rotated without being asked (at the next check).
    monkeypatch.setattr(act, "RECHECK", 0.0)
    judged_at(monkeypatch, datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3400))
    assert "CARotationStarted" in pass_with(serving(), serving())
    assert pki.certificates(secret("operator")["ca.crt"])[1] == trusted[0]


CERT_MANAGER = Options(cert_manager=True)


class CertManagerKube(FakeKube):
    """An API server with cert-manager's kinds (`installed`) or without; the Secrets cert-manager
    writes are put in `secrets` by the test."""

    def __init__(self, calls: Calls, installed: bool = True) -> None:
        super().__init__(calls, BODY)
        self.installed = installed
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        if resource in ("issuers", "certificates"):
            return self.objects.get((resource, name))
        return super().get(namespace, resource, name)

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        if resource in ("issuers", "certificates"):
            if not self.installed:
                raise ApiError("POST", f"/apis/cert-manager.io/v1/.../{resource}", 404, "")
            self.objects[(resource, body["metadata"]["name"])] = body
            self.calls.append(("create", resource, body["metadata"]["name"]))
            return body
        return super().create(namespace, resource, body)

    def patch(self, namespace: str, resource: str, name: str, body: dict[str, Any]) -> None:
        if resource == "secrets" and "data" not in body:
            self.secrets[name].setdefault("metadata", {}).update(body["metadata"])
            self.calls.append(("own", name))
            return
        super().patch(namespace, resource, name, body)

    def issue(self) -> bytes:
        """Write the Secrets as cert-manager would; the CA's certificate."""
        ca = pki.new_authority()
        pairs = {
            "tiny-agent-tls": pki.serving_pair(ca, "tiny", "ns"),
            "tiny-operator-tls": pki.operator_pair(ca),
        }
        for name, pair in pairs.items():
            data = {"ca.crt": ca.cert, "tls.crt": pair.cert, "tls.key": pair.key}
            encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
            self.secrets[name] = {"metadata": {"name": name}, "data": encoded}
        return ca.cert


def pending_reason(calls: Calls) -> dict[str, Any]:
    """The Ready condition of the one status the pass wrote."""
    (status,) = [c[1] for c in calls if c[0] == "status"]
    assert status["phase"] == "Pending"
    return dict(next(c for c in status["conditions"] if c["type"] == "Ready"))


def test_without_cert_managers_kinds_the_job_waits_with_a_condition_naming_it() -> None:
    calls: Calls = []
    controller = JobController(CertManagerKube(calls, installed=False), "ns", "tiny",
                               lambda *_: None, options=CERT_MANAGER)  # type: ignore[arg-type]  # fmt: skip
    assert controller.reconcile()
    ready = pending_reason(calls)
    assert ready["reason"] == "CertificatesPending"
    assert "serves no cert-manager.io/v1 Issuer: install cert-manager" in ready["message"]
    assert not [c for c in calls if c[0] == "create"]  # no pod, nothing else


def test_cert_managers_objects_are_made_once_and_its_secrets_read_when_issued() -> None:
    calls: Calls = []
    kube = CertManagerKube(calls)
    controller = JobController(kube, "ns", "tiny", lambda *_: None, options=CERT_MANAGER)  # type: ignore[arg-type]
    assert controller.reconcile()
    made = [c[1:] for c in calls if c[0] == "create"]
    assert made == [("issuers", "tiny-selfsigned"), ("certificates", "tiny-ca"),
                    ("issuers", "tiny-ca"), ("certificates", "tiny-agent-tls"),
                    ("certificates", "tiny-operator-tls")]  # fmt: skip
    ready = pending_reason(calls)
    assert ready["reason"] == "CertificatesPending"
    assert "waiting for cert-manager to issue Secret tiny-agent-tls" in ready["message"]
    assert not kube.secrets  # the operator issued nothing itself

    ca = kube.issue()
    calls.clear()
    certs = controller.executor.certificates
    certs.ensure(BODY)
    assert calls == [("own", "tiny-agent-tls"), ("own", "tiny-operator-tls")]  # and nothing made
    for secret in kube.secrets.values():
        assert secret["metadata"]["ownerReferences"] == [render.owner(BODY)]
    assert certs.serving is not None and pki.issued_by(certs.serving.cert, ca)
    assert certs.serving_ca == ca
    tls = certs.client_tls()
    assert tls.ca == ca and pki.issued_by(tls.cert, ca)
    assert tls.server_name == pki.server_name("tiny", "ns")
    calls.clear()
    certs.ensure(BODY)
    assert calls == []  # owned already: nothing to do

    # The Secrets gone (deleted by hand, cert-manager issuing them again): the pass goes on with
    # what it read.
    kube.secrets.clear()
    certs.ensure(BODY)
    assert certs.client_tls() is tls


def test_cert_managers_certificates_ask_for_what_the_operator_would_issue() -> None:
    objects = dict(((r, o["metadata"]["name"]), o) for r, o in render.cert_manager_objects(BODY))
    assert objects[("issuers", "tiny-selfsigned")]["spec"] == {"selfSigned": {}}
    assert objects[("issuers", "tiny-ca")]["spec"] == {"ca": {"secretName": "tiny-ca"}}
    ca = objects[("certificates", "tiny-ca")]["spec"]
    assert ca["isCA"] and ca["issuerRef"]["name"] == "tiny-selfsigned"
    assert ca["privateKey"]["rotationPolicy"] == "Never"  # what it signed stays trusted
    assert ca["duration"] == "87600h"
    serving = objects[("certificates", "tiny-agent-tls")]["spec"]
    assert serving["secretName"] == "tiny-agent-tls" and serving["issuerRef"]["name"] == "tiny-ca"
    assert serving["dnsNames"] == [pki.server_name("tiny", "ns")]
    assert "server auth" in serving["usages"] and "client auth" not in serving["usages"]
    client = objects[("certificates", "tiny-operator-tls")]["spec"]
    assert client["commonName"] == pki.OPERATOR_NAME
    assert "client auth" in client["usages"] and "server auth" not in client["usages"]
    for spec in (serving, client):
        assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
        assert (spec["duration"], spec["renewBefore"]) == ("8760h", "720h")
    for obj in objects.values():
        assert obj["metadata"]["ownerReferences"] == [render.owner(BODY)]


def test_a_users_issuer_issues_the_two_certificates_and_nothing_else_is_made() -> None:
    corp = render.IssuerRef("corp-ca", "ClusterIssuer")
    calls: Calls = []
    kube = CertManagerKube(calls)
    options = Options(cert_manager=True, cert_manager_issuer=corp)
    controller = JobController(kube, "ns", "tiny", lambda *_: None, options=options)  # type: ignore[arg-type]
    assert controller.reconcile()
    made = [c[1:] for c in calls if c[0] == "create"]
    assert made == [("certificates", "tiny-agent-tls"), ("certificates", "tiny-operator-tls")]
    for _, name in made:
        ref = kube.objects[("certificates", name)]["spec"]["issuerRef"]
        assert ref == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert "of ClusterIssuer corp-ca;" in pending_reason(calls)["message"]

    # An issuer that gives no CA certificate (an ACME one) cannot be trusted by name: the
    # condition says so.
    kube.issue()
    for secret in kube.secrets.values():
        del secret["data"]["ca.crt"]
    calls.clear()
    assert controller.reconcile()
    message = pending_reason(calls)["message"]
    assert "issued without ca.crt" in message and "ClusterIssuer corp-ca must" in message

    ca = kube.issue()
    certs = controller.executor.certificates
    certs.ensure(BODY)
    assert certs.serving_ca == ca and certs.client_tls().ca == ca
    external = render.IssuerRef("pca", "AWSPCAClusterIssuer", "awspca.cert-manager.io")
    assert str(external) == "AWSPCAClusterIssuer.awspca.cert-manager.io pca"
    ((_, serving), _) = render.cert_manager_objects(BODY, external)
    assert serving["spec"]["issuerRef"]["group"] == "awspca.cert-manager.io"
