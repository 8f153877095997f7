"""A job's certificates against the fake API server and agents of `test_act`: issued once,
renewed when due and sent to the agents that serve another pair; the CA rotated when asked or
due, step by step. tests/e2e/test_operator.py runs the same on the local cluster."""

from __future__ import annotations

import base64
import copy
import datetime

import pytest
from liveshard_operator import pki, render
from liveshard_operator.certificates import Certificates

from tests.operator.test_act import NOW_PLUS_A_YEAR, Calls, FakeAgent, FakeKube
from tests.operator.values import BODY, pod, seen, standby


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


def test_the_ca_rotates_when_asked_or_due_trusting_both_until_every_agent_serves_the_new(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls, kube, certs = issued()

    def secret(name: str) -> dict[str, bytes]:
        return {k: base64.b64decode(v) for k, v in kube.secrets[f"tiny-{name}-tls"]["data"].items()}

    old_ca, first_client = secret("operator")["ca.crt"], secret("operator")["tls.crt"]
    certs.clients.update({m: FakeAgent(m, calls) for m in ("p0", "p1")})  # type: ignore[misc]

    def pass_with(*served: str, silent: bool = False) -> list[str]:
        """A pass over agents serving `served` (and a silent one): the events it posted."""
        calls.clear()
        certs.ensure(annotated)
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

    # A CA with less than a year left is rotated without being asked.
    judged_at(monkeypatch, datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3400))
    assert "CARotationStarted" in pass_with(serving(), serving())
    assert pki.certificates(secret("operator")["ca.crt"])[1] == trusted[0]
