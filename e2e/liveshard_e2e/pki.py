"""The cluster's certificates and keys: one CA, the API server's serving cert, client certs for
the admin and the control-plane components, and the service-account signing key pair.

Everything is written as PEM files into one folder; nothing here talks to a process.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=3650)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, as PEM file paths."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Every credential file of one cluster."""

    ca: KeyPair
    apiserver: KeyPair
    admin: KeyPair
    apiserver_kubelet_client: KeyPair
    sa_public: Path
    sa_private: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _issue(
    folder: Path,
    stem: str,
    subject: x509.Name,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    server: bool,
    sans: list[x509.GeneralName] | None = None,
) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    pair = KeyPair(cert=folder / f"{stem}.crt", key=folder / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pair.key, key)
    return pair


def create_pki(folder: Path) -> Pki:
    """Writes a fresh CA and every cert and key the cluster needs into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_name = _name("liveshard-local-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca = KeyPair(cert=folder / "ca.crt", key=folder / "ca.key")
    ca.cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(ca.key, ca_key)

    sans: list[x509.GeneralName] = [
        x509.DNSName(n)
        for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
    ]
    # 169.254.1.1: where pods in network namespaces of their own reach it (kubelet.netns).
    addresses = ("127.0.0.1", "10.0.0.1", "169.254.1.1")
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    apiserver = _issue(
        folder, "apiserver", _name("kube-apiserver"), ca_cert, ca_key, server=True, sans=sans
    )
    admin = _issue(folder, "admin", _name("admin", "system:masters"), ca_cert, ca_key, server=False)
    kubelet_client = _issue(
        folder,
        "apiserver-kubelet-client",
        _name("kube-apiserver-kubelet-client", "system:masters"),
        ca_cert,
        ca_key,
        server=False,
    )

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_private, sa_public = folder / "sa.key", folder / "sa.pub"
    _write_key(sa_private, sa_key)
    sa_public.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Pki(
        ca=ca,
        apiserver=apiserver,
        admin=admin,
        apiserver_kubelet_client=kubelet_client,
        sa_public=sa_public,
        sa_private=sa_private,
    )


def issue_serving_cert(pki: Pki, folder: Path, stem: str, ips: list[str]) -> KeyPair:
    """A serving certificate signed by the cluster CA (used by the kubelet's log server)."""
    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca.key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca.key}: expected an EC key, got {type(ca_key).__name__}")
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    sans.append(x509.DNSName("localhost"))
    return _issue(folder, stem, _name(stem), ca_cert, ca_key, server=True, sans=sans)
