"""A job's CA and certificates (`pki`), the Secrets that hold them (`render`, `act`): what each
certificate may be used for, that the workers' Secret holds no CA key, that they are issued once
and read back by every later pass and every other operator replica, and how often a pass checks
them."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from liveshard_operator import act, pki, render
from liveshard_operator.act import Executor
from liveshard_operator.kube import ApiError

from tests.operator.values import BODY, job

NAME = pki.server_name("tiny", "ns")


def cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def usages(pem: bytes) -> list[x509.ObjectIdentifier]:
    return list(cert(pem).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_the_certificates_chain_to_the_jobs_ca_each_for_one_use() -> None:
    ca = pki.new_authority()
    serving, client = pki.serving_pair(ca, "tiny", "ns"), pki.operator_pair(ca)
    root = cert(ca.cert)
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for pair in (serving, client):
        issued = cert(pair.cert)
        issued.verify_directly_issued_by(root)
        assert not issued.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        lifetime = issued.not_valid_after_utc - issued.not_valid_before_utc
        assert dt.timedelta(days=364) < lifetime < dt.timedelta(days=366)
    assert usages(serving.cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert usages(client.cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    names = cert(serving.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.DNSName) == [NAME] == ["agent.tiny.ns.liveshard"]
    subject = cert(client.cert).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert subject[0].value == "liveshard-operator"
    # Another CA, even one of a job of the same name, signed none of them.
    assert not pki.issued_by(client.cert, pki.new_authority().cert)


def test_names_as_long_as_kubernetes_allows_fit_the_certificates() -> None:
    job, namespace = "j" * 63, "n" * 63  # a CN holds at most 64 characters
    ca = pki.new_authority()
    names = cert(pki.serving_pair(ca, job, namespace).cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert names.value.get_values_for_type(x509.DNSName) == [pki.server_name(job, namespace)]


class Secrets:
    """The API server's Secrets of one namespace: created once (409 after), read as `data`."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.created: list[str] = []

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        return self.stored.get(name) if resource == "secrets" else {}

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name in self.stored:
            raise ApiError("POST", f"secrets/{name}", 409, '{"reason":"AlreadyExists"}')
        data = {k: base64.b64encode(v.encode()).decode() for k, v in body["stringData"].items()}
        self.stored[name] = {"metadata": body["metadata"], "data": data}
        self.created.append(name)
        return self.stored[name]

    def data(self, name: str) -> dict[str, bytes]:
        return {k: base64.b64decode(v) for k, v in self.stored[name]["data"].items()}


def executor(kube: Secrets) -> Executor:
    return Executor(kube, "ns", "tiny", lambda *_: None, {})  # type: ignore[arg-type]


def test_the_tls_secrets_are_issued_once_and_read_back_by_every_replica() -> None:
    kube = Secrets()
    first = executor(kube)
    first.ensure_objects(BODY, job().spec)
    assert kube.created == ["tiny-token", "tiny-operator-tls", "tiny-agent-tls"]
    operator, agent = kube.data("tiny-operator-tls"), kube.data("tiny-agent-tls")
    assert set(agent) == {"ca.crt", "tls.crt", "tls.key"}  # no CA key, no client certificate
    assert set(operator) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    assert agent["ca.crt"] == operator["ca.crt"]
    cert(agent["tls.crt"]).verify_directly_issued_by(cert(operator["ca.crt"]))
    for name in kube.created:
        assert kube.stored[name]["metadata"]["ownerReferences"] == [render.owner(BODY)]
    # A later pass, and another replica, create nothing and present the same certificate.
    second = executor(kube)
    for each in (first, second):
        each.ensure_objects(BODY, job().spec)
    assert len(kube.created) == 3
    tls = second.certificates.client_tls()
    assert (tls.ca, tls.cert, tls.server_name) == (operator["ca.crt"], operator["tls.crt"], NAME)
    assert tls == first.certificates.client_tls()


def test_a_workers_secret_lost_is_issued_again_from_the_same_ca() -> None:
    kube = Secrets()
    executor(kube).ensure_objects(BODY, job().spec)
    before = kube.data("tiny-agent-tls")
    del kube.stored["tiny-agent-tls"]
    executor(kube).ensure_objects(BODY, job().spec)
    after = kube.data("tiny-agent-tls")
    assert after["tls.crt"] != before["tls.crt"] and after["ca.crt"] == before["ca.crt"]


class Racing(Secrets):
    """Another replica creates the operator's Secret between this one's read and its create."""

    def create(self, namespace: str, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name == "tiny-operator-tls" and name not in self.stored:
            ca = pki.new_authority()
            pair = pki.operator_pair(ca)
            super().create(
                namespace, resource,
                render.operator_tls_secret(BODY, ca.cert, ca.key, pair.cert, pair.key),
            )  # fmt: skip
        return super().create(namespace, resource, body)


def test_the_secret_another_replica_created_first_is_the_one_used() -> None:
    kube = Racing()
    executor(kube).ensure_objects(BODY, job().spec)
    operator, agent = kube.data("tiny-operator-tls"), kube.data("tiny-agent-tls")
    cert(agent["tls.crt"]).verify_directly_issued_by(cert(operator["ca.crt"]))


def test_workers_get_the_agent_tls_secret_and_are_known_to_serve_tls() -> None:
    pod = render.worker_pod(BODY, job().spec)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    for variable, key in (("LIVESHARD_TLS_CERT", "tls.crt"), ("LIVESHARD_TLS_KEY", "tls.key"),
                          ("LIVESHARD_TLS_CA", "ca.crt")):  # fmt: skip
        assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": "tiny-agent-tls", "key": key}
    assert render.serves_tls(pod)
    # A pod an operator without TLS created keeps being called in plaintext.
    assert not render.serves_tls({"spec": {"containers": [{"env": [env["LIVESHARD_TOKEN"]]}]}})


def test_renewal_is_due_in_the_last_month_or_the_last_tenth_of_a_short_validity() -> None:
    ca = pki.new_authority()
    now = dt.datetime.now(dt.UTC)
    year = pki.operator_pair(ca).cert
    assert not pki.renewal_due(year, now)
    assert not pki.renewal_due(year, now + dt.timedelta(days=330))
    assert pki.renewal_due(year, now + dt.timedelta(days=340))
    hour = pki.operator_pair(ca, validity=dt.timedelta(hours=1)).cert
    assert not pki.renewal_due(hour, now + dt.timedelta(minutes=50))
    assert pki.renewal_due(hour, now + dt.timedelta(minutes=58))
    # The CA outlives ten renewals of the certificates it signs.
    assert not pki.renewal_due(ca.cert, now + dt.timedelta(days=9 * 365))
    # It is rotated while what it signs can still end first: in its last year.
    assert not pki.renewal_due(ca.cert, now + dt.timedelta(days=9 * 365 - 5), pki.CA_RENEW_BEFORE)
    assert pki.renewal_due(ca.cert, now + dt.timedelta(days=9 * 365 + 5), pki.CA_RENEW_BEFORE)


def test_a_rotations_bundle_holds_two_cas_each_known_by_what_it_signed() -> None:
    old, new = pki.new_authority(), pki.new_authority()
    assert pki.certificates(new.cert + old.cert) == [new.cert, old.cert]
    names = {x509.load_pem_x509_certificate(c.cert).subject for c in (old, new)}
    assert len(names) == 2  # told apart by name as well as by key
    of_new = pki.serving_pair(new, "tiny", "ns").cert
    assert pki.issued_by(of_new, new.cert) and not pki.issued_by(of_new, old.cert)
    assert not pki.issued_by(of_new, of_new)


class Counted(Secrets):
    """`Secrets` that count the reads, and take patches of their data."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return super().get(namespace, resource, name)

    def patch(self, namespace: str, resource: str, name: str, body: dict[str, Any]) -> None:
        self.stored[name]["data"].update(body["data"])


def test_passes_trust_the_last_check_of_the_jobs_objects_until_it_is_due_or_the_job_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kube = Counted()
    each = executor(kube)
    monkeypatch.setattr(act, "RECHECK", 3600.0)
    each.ensure_objects(BODY, job().spec)
    token = each.token()
    reads = kube.reads
    del kube.stored["tiny-agent-tls"]  # lost meanwhile
    each.ensure_objects(BODY, job().spec)
    assert (kube.reads, each.token()) == (reads, token)  # nothing asked
    assert "tiny-agent-tls" not in kube.stored
    # Each of these is checked at once: another job of the same name, a spec edited, a CA
    # rotation asked for.
    metadata = BODY["metadata"]
    for changed in ({"uid": "u-2"}, {"generation": metadata["generation"] + 1},
                    {"annotations": {render.ROTATE_CA: "now"}}):  # fmt: skip
        body = {**BODY, "metadata": {**metadata, **changed}}
        each.ensure_objects(body, job().spec)
        assert "tiny-agent-tls" in kube.stored
        del kube.stored["tiny-agent-tls"]
    # And the same job once the check is due.
    monkeypatch.setattr(act, "RECHECK", 0.0)
    each.ensure_objects(BODY, job().spec)
    assert "tiny-agent-tls" in kube.stored and each.token() == token
