"""The agent API's serving certificate and the CAs its clients' certificates must chain to, both
replaceable while the server runs: the operator renews the certificate from the job's CA before
it expires, and rotates the CA itself (the new and the old trusted together until every agent
serves a certificate of the new, then the new alone), and sends each with RotateCertificate.

grpc asks `ServingCertificate.fetch` at each new handshake: it gets the new configuration once,
then None (keep it); connections already open keep theirs. A pair is checked before it is taken:
its key must match its certificate, and the certificate must chain to the CAs it is to be served
under and be valid now, which a TLS handshake in memory proves (the new pair serving, a client
that trusts only those CAs). A bad pair is refused by name and the configuration in use stays.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import tempfile
import threading
from pathlib import Path

import grpc

from liveshard_core.errors import InvalidInput

from .config import Tls

_HANDSHAKE_ROUNDS = 8  # TLS 1.3 takes two; a handshake that needs more has failed


def fingerprint(cert: bytes) -> str:
    """SHA-256 of the DER bytes of a PEM's first certificate, hex: what an agent reports it
    serves."""
    text = cert.decode("ascii", "replace")
    start = text.find(ssl.PEM_HEADER)
    end = text.find(ssl.PEM_FOOTER, start) + len(ssl.PEM_FOOTER)
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(text[start:end])).hexdigest()


Serving = tuple[bytes, bytes, bytes]
"""The private key and certificate served, and the CA certificates clients' must chain to (PEM)."""


class ServingCertificate:
    """The pair the API serves and the CAs its clients' certificates must chain to."""

    def __init__(self, tls: Tls) -> None:
        self._serving: Serving = (tls.key, tls.cert, tls.ca)
        self._new: Serving | None = None  # taken by the next handshake
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        with self._lock:
            return fingerprint(self._serving[1])

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _config(self._serving),
            self._fetch,  # type: ignore[arg-type]  # grpc takes None: keep the pair in use
            require_client_authentication=True,
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            new, self._new = self._new, None
        return None if new is None else _config(new)

    def replace(self, cert: bytes, key: bytes, ca: bytes = b"") -> str:
        """Serve `cert` and `key` (PEM) to new connections, and accept client certificates of
        the CAs `ca` (PEM; empty: those in use); InvalidInput naming what is wrong with them
        (nothing changes then). Returns the new certificate's fingerprint."""
        with self._lock:
            trusted = ca or self._serving[2]
        check_pair(cert, key, trusted)
        with self._lock:
            self._serving = self._new = (key, cert, trusted)
        return fingerprint(cert)


def _config(serving: Serving) -> grpc.ServerCertificateConfiguration:
    key, cert, ca = serving
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def check_pair(cert: bytes, key: bytes, ca: bytes) -> None:
    """InvalidInput unless `key` is `cert`'s and `cert` chains to one of the CAs `ca` and is
    valid now."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="liveshard-cert-") as folder:  # mode 0700
        cert_path, key_path = Path(folder, "tls.crt"), Path(folder, "tls.key")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            server.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, ValueError) as err:
            raise InvalidInput(
                f"cert, key: not a PEM certificate and its own private key ({err})"
            ) from None
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # the name is the operator's to check; the chain is ours
    try:
        client.load_verify_locations(cadata=ca.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError) as err:
        raise InvalidInput(f"ca: not PEM CA certificates ({err})") from None
    try:
        _handshake(client, server)
    except ssl.SSLCertVerificationError as err:
        raise InvalidInput(f"cert: not valid under the job's CA: {err.verify_message}") from None
    except ssl.SSLError as err:
        raise InvalidInput(f"cert: no TLS handshake could be made with it: {err}") from None


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> None:
    """A TLS handshake between the two contexts over memory buffers; raises ssl's error."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(to_client, to_server)
    s = server.wrap_bio(to_server, to_client, server_side=True)
    done = {c: False, s: False}
    for _ in range(_HANDSHAKE_ROUNDS):
        for side in (c, s):
            if not done[side]:
                try:
                    side.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
        if all(done.values()):
            return
    raise ssl.SSLError("the handshake did not complete")
