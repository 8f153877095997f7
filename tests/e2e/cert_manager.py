"""What cert-manager's controller does for a namespace, played by the test that runs the operator
with `--cert-manager` (cert-manager itself does not run on the local cluster; its kinds are
installed from `cert-manager-crds.yaml`). No test lives here.

`CertManager` issues every Certificate of the namespace whose Secret is missing, from the Issuer it
names (`selfSigned`, or `ca`: the pair in the Secret that Issuer names), into its Secret as
cert-manager writes one: type kubernetes.io/tls, keys `tls.crt`, `tls.key` and `ca.crt` (the
issuing CA's certificate; a self-signed one's own). It follows the Certificate's commonName,
dnsNames, isCA, usages, duration and its key's algorithm and rotation policy (ECDSA P-256 only).
`renew` issues one again, as cert-manager does when a certificate is due.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import threading
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from liveshard_e2e.testing import Kube

log = logging.getLogger(__name__)

API = "/apis/cert-manager.io/v1"
EXTENDED = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH,
            "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}  # fmt: skip


class CertManager:
    """Issues the namespace's Certificates every half second in a thread, while in a `with`."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="cert-manager", daemon=True)

    def __enter__(self) -> CertManager:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                for cert in self._list("certificates"):
                    try:
                        if self._secret(cert["spec"]["secretName"]) is None:
                            self._issue(cert)
                    except Exception as err:  # tried again next round, as cert-manager does
                        log.info("Certificate %s: %s", cert["metadata"]["name"], err)

    def renew(self, certificate: str) -> bytes:
        """Issue Certificate `certificate` again; the new certificate (PEM)."""
        with self._lock:
            cert = self.kube.get(f"{self._base()}/certificates/{certificate}")
            assert cert is not None, f"no Certificate {certificate}"
            return self._issue(cert)

    def _base(self) -> str:
        return f"{API}/namespaces/{self.kube.namespace}"

    def _list(self, plural: str) -> list[dict[str, Any]]:
        return list((self.kube.get(f"{self._base()}/{plural}") or {}).get("items") or [])

    def _secret(self, name: str) -> dict[str, bytes] | None:
        secret = self.kube.get(f"/api/v1/namespaces/{self.kube.namespace}/secrets/{name}")
        if secret is None:
            return None
        return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}

    def _issue(self, cert: dict[str, Any]) -> bytes:
        spec = cert["spec"]
        issuer = self.kube.get(f"{self._base()}/issuers/{spec['issuerRef']['name']}")
        if issuer is None:
            raise LookupError(f"Certificate {cert['metadata']['name']}: no Issuer")
        old = self._secret(spec["secretName"]) or {}
        keep = (spec.get("privateKey") or {}).get("rotationPolicy") == "Never" and "tls.key" in old
        key = (serialization.load_pem_private_key(old["tls.key"], None) if keep
               else ec.generate_private_key(ec.SECP256R1()))  # fmt: skip
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec.get("commonName", ""))])
        if "selfSigned" in issuer["spec"]:
            signer, issuer_name, ca_pem = key, subject, b""
        else:
            pair = self._secret(issuer["spec"]["ca"]["secretName"])
            if pair is None:
                raise LookupError(f"Issuer {issuer['metadata']['name']}: its CA is not issued yet")
            ca = x509.load_pem_x509_certificate(pair["tls.crt"])
            signer = serialization.load_pem_private_key(pair["tls.key"], None)  # type: ignore[assignment]
            issuer_name, ca_pem = ca.subject, pair["tls.crt"]
        usages = set(spec.get("usages") or ["digital signature", "key encipherment"])
        now = dt.datetime.now(dt.UTC)
        constraints = x509.BasicConstraints(ca=bool(spec.get("isCA")), path_length=None)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + _duration(spec.get("duration", "2160h")))
            .add_extension(constraints, critical=True)
            .add_extension(_key_usage(usages), critical=True)
        )
        extended = [EXTENDED[u] for u in sorted(usages) if u in EXTENDED]
        if extended:
            builder = builder.add_extension(x509.ExtendedKeyUsage(extended), critical=False)
        if spec.get("dnsNames"):
            names = [x509.DNSName(n) for n in spec["dnsNames"]]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        pem = builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())  # fmt: skip
        data = {"tls.crt": pem, "tls.key": key_pem, "ca.crt": ca_pem or pem}
        self._write(spec["secretName"], data, replace=bool(old))
        log.info("issued Certificate %s", cert["metadata"]["name"])
        return pem

    def _write(self, name: str, data: dict[str, bytes], replace: bool) -> None:
        encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
        if replace:  # keeps what others put on it (the operator's owner reference)
            self.kube.kubectl("patch", "secret", name, "--type", "merge", "-p",
                              json.dumps({"data": encoded}))  # fmt: skip
            return
        self.kube.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                         "metadata": {"name": name}, "data": encoded})  # fmt: skip


def _duration(value: str) -> dt.timedelta:
    """A Go duration of hours, minutes or seconds ("8760h", "90m", "30s")."""
    unit = {"h": "hours", "m": "minutes", "s": "seconds"}[value[-1]]
    return dt.timedelta(**{unit: float(value[:-1])})


def _key_usage(usages: set[str]) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature="digital signature" in usages, content_commitment=False,
        key_encipherment="key encipherment" in usages, data_encipherment=False,
        key_agreement=False, key_cert_sign="cert sign" in usages, crl_sign="crl sign" in usages,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
