"""The agent API's mutual TLS over real gRPC on 127.0.0.1: the server (`rpc.start_server`) with a
job's certificates from the operator's `pki`, in front of a stand-in service that answers
GetStatus. Only a client certificate the job's CA signed for client auth gets through; the
token is still checked behind it. And a real agent process whose serving certificate is rotated
over its API: new connections get the new one, a bad pair is refused and changes nothing."""

from __future__ import annotations

import hashlib
import socket
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("torch", reason="the agent's server imports torch (the agent extra)")

from liveshard_operator import pki

from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_agent.server.certs import ServingCertificate
from liveshard_agent.server.config import Tls
from liveshard_agent.server.rpc import start_server

from .agents import HOST, TOKEN, Agent, free_port

JOB, NAMESPACE = "tiny", "ns"
NAME = pki.server_name(JOB, NAMESPACE)


class Answering:
    """The service's GetStatus only: what is tested here is who reaches it."""

    def get_status(self, request: Any, context: Any) -> pb.AgentStatus:
        return pb.AgentStatus(member="a0")

    def __getattr__(self, name: str) -> Any:
        return self.get_status


@pytest.fixture(scope="module")
def ca() -> pki.Authority:
    return pki.new_authority()


@pytest.fixture(scope="module")
def serving(ca: pki.Authority) -> pki.Pair:
    return pki.serving_pair(ca, JOB, NAMESPACE)


@pytest.fixture(scope="module")
def address(ca: pki.Authority, serving: pki.Pair) -> Iterator[str]:
    address = f"{HOST}:{free_port()}"
    tls = ServingCertificate(Tls(serving.cert, serving.key, ca.cert))
    server = start_server(Answering(), TOKEN, address, tls)  # type: ignore[arg-type]
    yield address
    server.stop(grace=None)


def status(channel: grpc.Channel, token: str = TOKEN) -> pb.AgentStatus:
    stub = pb_grpc.AgentStub(channel)  # type: ignore[no-untyped-call]  # generated
    answer = stub.GetStatus(
        pb.GetStatusRequest(), timeout=5, metadata=(("authorization", f"Bearer {token}"),)
    )
    return answer  # type: ignore[no-any-return]


def secure(address: str, ca: bytes, client: pki.Pair | None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    return grpc.secure_channel(address, credentials, [("grpc.ssl_target_name_override", NAME)])


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as err:
        status(channel)
    return err.value.code()  # type: ignore[no-any-return]


def test_the_operator_certificate_is_accepted_and_the_token_still_checked(
    address: str, ca: pki.Authority
) -> None:
    with secure(address, ca.cert, pki.operator_pair(ca)) as channel:
        assert status(channel).member == "a0"
        with pytest.raises(grpc.RpcError) as err:
            status(channel, token="not-the-token")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_plaintext_client_is_refused(address: str) -> None:
    assert refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_is_refused(address: str, ca: pki.Authority) -> None:
    assert refused(secure(address, ca.cert, None)) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_of_another_job_is_refused(address: str, ca: pki.Authority) -> None:
    other = pki.new_authority()
    assert refused(secure(address, ca.cert, pki.operator_pair(other))) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_the_workers_serving_certificate_is_no_client_certificate(
    address: str, ca: pki.Authority, serving: pki.Pair
) -> None:
    """What worker code holds (the serving pair and the CA certificate) cannot call a peer:
    the serving certificate's extended key usage is serverAuth only."""
    assert refused(secure(address, ca.cert, serving)) == grpc.StatusCode.UNAVAILABLE


def test_a_server_of_another_job_is_not_trusted(ca: pki.Authority) -> None:
    """The operator's client checks the agent too: a server whose certificate another CA signed
    is refused."""
    other = pki.new_authority()
    other_serving = pki.serving_pair(other, JOB, NAMESPACE)
    address = f"{HOST}:{free_port()}"
    server = start_server(
        Answering(),  # type: ignore[arg-type]
        TOKEN, address, ServingCertificate(Tls(other_serving.cert, other_serving.key, ca.cert)),
    )  # fmt: skip
    try:
        assert refused(secure(address, ca.cert, pki.operator_pair(ca))) == (
            grpc.StatusCode.UNAVAILABLE
        )
    finally:
        server.stop(grace=None)


def served_fingerprint(address: str, ca: bytes, client: pki.Pair) -> str:
    """The fingerprint of the certificate a new TLS connection to `address` is served."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=ca.decode())
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory() as folder:
        cert, key = Path(folder, "c"), Path(folder, "k")
        cert.write_bytes(client.cert)
        key.write_bytes(client.key)
        context.load_cert_chain(cert, key)
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=NAME) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def test_an_agents_serving_certificate_is_rotated_over_its_api(
    tmp_path: Path, ca: pki.Authority, serving: pki.Pair
) -> None:
    operator = pki.operator_pair(ca)
    env = {"LIVESHARD_TLS_CERT": serving.cert.decode(), "LIVESHARD_TLS_KEY": serving.key.decode(),
           "LIVESHARD_TLS_CA": ca.cert.decode()}  # fmt: skip
    agent = Agent("a0", tmp_path, **env)
    try:
        address = f"{HOST}:{agent.port}"
        agent.channel = secure(address, ca.cert, operator)
        agent.stub = pb_grpc.AgentStub(agent.channel)  # type: ignore[no-untyped-call]
        first = agent.wait_ready().serving_certificate
        assert (
            first == pki.fingerprint(serving.cert) == served_fingerprint(address, ca.cert, operator)
        )
        # Refused by name, and the certificate in use stays.
        other = pki.serving_pair(pki.new_authority(), JOB, NAMESPACE)
        renewed = pki.serving_pair(ca, JOB, NAMESPACE)
        for cert, key, words in [
            (other.cert, other.key, "not valid under the job's CA"),
            (renewed.cert, serving.key, "not a PEM certificate and its own private key"),
            (b"garbage", b"garbage", "not a PEM certificate"),
        ]:
            err = agent.refused(
                "RotateCertificate", pb.RotateCertificateRequest(cert=cert, key=key)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert words in (err.details() or ""), err.details()
        assert agent.status().serving_certificate == first
        assert served_fingerprint(address, ca.cert, operator) == first
        # A renewed pair from the job's CA: new connections get it, the open channel goes on.
        agent.call(
            "RotateCertificate", pb.RotateCertificateRequest(cert=renewed.cert, key=renewed.key)
        )
        assert agent.status().serving_certificate == pki.fingerprint(renewed.cert) != first
        assert served_fingerprint(address, ca.cert, operator) == pki.fingerprint(renewed.cert)
        with secure(address, ca.cert, operator) as fresh:
            assert status(fresh).member == "a0"

        # The job's CA rotates. A pair the CAs it is to be served under do not sign, or CAs that
        # are no PEM, change nothing.
        new_ca = pki.new_authority()
        both = new_ca.cert + ca.cert
        of_new = pki.serving_pair(new_ca, JOB, NAMESPACE)
        for bundle, words in [(ca.cert, "not valid under the job's CA"),
                              (b"garbage", "ca: not PEM CA certificates")]:  # fmt: skip
            err = agent.refused("RotateCertificate", pb.RotateCertificateRequest(
                cert=of_new.cert, key=of_new.key, ca=bundle
            ))  # fmt: skip
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert words in (err.details() or ""), err.details()
        assert agent.status().serving_certificate == pki.fingerprint(renewed.cert)
        # A pair of the new CA served under both: the operator's certificates of either CA are
        # accepted.
        agent.call("RotateCertificate", pb.RotateCertificateRequest(
            cert=of_new.cert, key=of_new.key, ca=both
        ))  # fmt: skip
        new_operator = pki.operator_pair(new_ca)
        for client in (operator, new_operator):
            with secure(address, both, client) as fresh:
                assert status(fresh).member == "a0"
        assert served_fingerprint(address, both, operator) == pki.fingerprint(of_new.cert)
        # The old CA dropped: a client certificate of it is refused from then on.
        last = pki.serving_pair(new_ca, JOB, NAMESPACE)
        agent.call("RotateCertificate", pb.RotateCertificateRequest(
            cert=last.cert, key=last.key, ca=new_ca.cert
        ))  # fmt: skip
        assert refused(secure(address, both, operator)) == grpc.StatusCode.UNAVAILABLE
        with secure(address, new_ca.cert, new_operator) as fresh:
            assert status(fresh).serving_certificate == pki.fingerprint(last.cert)
    finally:
        agent.close()
