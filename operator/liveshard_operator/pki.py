"""A job's certificates: the job's own CA, the serving certificate every worker's agent presents,
and the client certificate the operator presents to them (the agent API's mutual TLS).

Everything is EC P-256 and held as PEM bytes. The CA is valid for ten years, the other
certificates for one; the operator renews those from the same CA once less than `RENEW_BEFORE`
of their validity is left (`renewal_due`), and tells each agent its new one (agents report the
`fingerprint` they serve). It rotates the CA itself in its last year (`CA_RENEW_BEFORE`) or when
asked: a bundle of CA certificates (`certificates`, the current CA first) is trusted meanwhile,
and `issued_by` tells which CA signed a certificate. Workers get the CA certificates and the
serving pair only; the CA key and the operator's pair never leave the
operator's Secret, so worker code cannot make a certificate an agent accepts. The serving
certificate names one fixed DNS name (`server_name`), since pod IPs are unknown at issuance:
the operator's client checks that name instead of the address it dials.

This module issues and parses; it talks to neither the API server nor an agent.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)
CA_VALIDITY = dt.timedelta(days=3650)
RENEW_BEFORE = dt.timedelta(days=30)
# A CA is rotated while a certificate it signs can still end before it does.
CA_RENEW_BEFORE = VALIDITY + RENEW_BEFORE
OPERATOR_NAME = "liveshard-operator"  # the CN of the operator's client certificate
# Fixed CNs: a CN holds at most 64 characters, a job's and namespace's names may hold more. The
# serving certificate's identity is its DNS name; a CA is known by its key, not its name.
AGENT_NAME, CA_NAME = "liveshard-agent", "liveshard-job-ca"
_BACKDATE = dt.timedelta(minutes=5)  # clocks of the nodes may lag the operator's


def server_name(job: str, namespace: str) -> str:
    """The DNS name in every worker's serving certificate, which the operator verifies."""
    return f"agent.{job}.{namespace}.liveshard"


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes = field(repr=False)


@dataclass(frozen=True)
class Authority:
    """A job's CA (its certificate and key, PEM): it signs the job's other certificates."""

    cert: bytes
    key: bytes = field(repr=False)

    def issue(
        self,
        common_name: str,
        usage: x509.ObjectIdentifier,
        dns: str = "",
        validity: dt.timedelta = VALIDITY,
    ) -> Pair:
        """A certificate for `common_name` signed by this CA, good for `usage` only (serverAuth
        or clientAuth), naming `dns` when given."""
        ca_cert = x509.load_pem_x509_certificate(self.cert)
        ca_key = serialization.load_pem_private_key(self.key, password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"CA key: expected an EC key, got {type(ca_key).__name__}")
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(_name(common_name), ca_cert.subject, key.public_key(), validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(signing=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if dns:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False
            )
        return Pair(_pem(builder.sign(ca_key, hashes.SHA256())), _key_pem(key))


def new_authority() -> Authority:
    """A fresh self-signed CA (one per job)."""
    key = ec.generate_private_key(ec.SECP256R1())
    # A serial number in the name: a rotation's trust bundle holds two CAs, told apart by it.
    name = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
        x509.NameAttribute(NameOID.SERIAL_NUMBER, secrets.token_hex(8)),
    ])  # fmt: skip
    cert = (
        _builder(name, name, key.public_key(), CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signing=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Authority(_pem(cert), _key_pem(key))


def serving_pair(
    ca: Authority, job: str, namespace: str, validity: dt.timedelta = VALIDITY
) -> Pair:
    """The workers' serving certificate: serverAuth only, so it is no client certificate."""
    return ca.issue(
        AGENT_NAME, ExtendedKeyUsageOID.SERVER_AUTH, server_name(job, namespace), validity
    )


def operator_pair(ca: Authority, validity: dt.timedelta = VALIDITY) -> Pair:
    """The operator's client certificate: clientAuth only."""
    return ca.issue(OPERATOR_NAME, ExtendedKeyUsageOID.CLIENT_AUTH, validity=validity)


def renewal_due(
    cert: bytes, now: dt.datetime | None = None, before: dt.timedelta = RENEW_BEFORE
) -> bool:
    """Whether `cert` (PEM) has less than `before` left, or a tenth of its whole validity when
    that is shorter (a short-lived certificate is not renewed at once)."""
    parsed = x509.load_pem_x509_certificate(cert)
    end, start = parsed.not_valid_after_utc, parsed.not_valid_before_utc
    left = end - (now or dt.datetime.now(dt.UTC))
    return left < min(before, (end - start) / 10)


def certificates(bundle: bytes) -> list[bytes]:
    """The certificates of a PEM bundle, each as PEM, in order."""
    return [_pem(c) for c in x509.load_pem_x509_certificates(bundle)]


def issued_by(cert: bytes, ca_cert: bytes) -> bool:
    """Whether the CA `ca_cert` signed `cert` (both PEM)."""
    try:
        x509.load_pem_x509_certificate(cert).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_cert)
        )
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def fingerprint(cert: bytes) -> str:
    """SHA-256 of the certificate's DER bytes, hex: what an agent reports it serves."""
    return x509.load_pem_x509_certificate(cert).fingerprint(hashes.SHA256()).hex()


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePublicKey,
    validity: dt.timedelta,
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC) - _BACKDATE
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _BACKDATE + validity)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key), critical=False)
    )


def _key_usage(*, signing: bool) -> x509.KeyUsage:
    """A CA's (`signing`: certificates and CRLs) or an end entity's (digital signatures)."""
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=signing, crl_sign=signing,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
