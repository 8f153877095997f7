"""A pod of several members behind one endpoint (`server.pod`), as real processes over real gRPC:
`liveshard-agent` with LIVESHARD_POD_MEMBERS=2 on 127.0.0.1, a supervisor and its 2 member agents
(3 processes per pod). Calls name their member with the `liveshard-member` metadata key; the
pod's /metrics merges its members'. Bad member counts exit before any member starts."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("torch", reason="the pod's members are agents, which need torch")

from liveshard_operator import pki
from liveshard_operator.agents import AgentClient, ClientTls
from liveshard_operator.observation import Observation
from liveshard_operator.observe import observe
from prometheus_client.parser import text_string_to_metric_families

from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_agent.server.config import TLS_VARIABLES, ConfigError, load
from liveshard_agent.server.pod import PodMember, member_env
from liveshard_core.job import MEMBER_KEY
from liveshard_e2e.testing import member_pids
from tests.helpers import OnePod, pod_body

from .agents import AGENT, HOST, TOKEN, WAIT, Agent, agent_env, free_port

Code = grpc.StatusCode
POD = "pod"
MEMBERS = [f"{POD}-0", f"{POD}-1"]
NAME = pki.server_name("tiny", "ns")


def metadata(member: str | None, token: str | None = TOKEN) -> tuple[tuple[str, str], ...]:
    pairs = [] if token is None else [("authorization", f"Bearer {token}")]
    return tuple(pairs + ([] if member is None else [(MEMBER_KEY, member)]))


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports on HOST (the pod's metrics port and its
    members')."""
    for _ in range(100):
        first = free_port()  # below the ephemeral range: no connection takes the next ones
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind((HOST, port))
            return first
        except OSError:
            continue
    raise AssertionError(f"no {count} consecutive free ports")


def start_pod(log_dir: Path, **env: object) -> Agent:
    return Agent(POD, log_dir, LIVESHARD_POD_MEMBERS=2, **env)


def route(pod: Agent, member: str) -> None:
    """The pod's calls, `Agent`'s own waits included, go to `member` from now on."""
    pod.metadata = metadata(member)  # type: ignore[assignment]  # an agent's carry 1 pair


def wait_members_ready(pod: Agent) -> None:
    """Both members ready, each reached through the pod's one port."""
    for member in MEMBERS:
        route(pod, member)
        assert pod.wait_ready().member == member


def assert_port_opens_once_members_serve(pod: Agent) -> None:
    """The pod's port, which a readiness probe connects to, opens only once every member's
    agent serves: at once, a call to either is answered, not refused as unreachable."""
    deadline = time.monotonic() + WAIT
    while True:
        with socket.socket() as probe:
            if probe.connect_ex((HOST, pod.port)) == 0:
                break
        assert pod.proc.poll() is None and time.monotonic() < deadline, pod.output()
        time.sleep(0.05)
    for member in MEMBERS:
        status = pod.call("GetStatus", pb.GetStatusRequest(), metadata=metadata(member))
        assert status.member == member


def close(pod: Agent) -> None:
    for pid in member_pids(pod.proc.pid).values() if pod.proc.poll() is None else ():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pod.close()


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """A plaintext pod of 2 members with metrics, shared by the module's tests; the last one
    stops it."""
    metrics_port = free_ports(3)
    started = start_pod(tmp_path_factory.mktemp("pod"), LIVESHARD_METRICS_PORT=metrics_port)
    try:
        assert_port_opens_once_members_serve(started)
        wait_members_ready(started)
        yield started
    finally:
        close(started)


def test_each_member_answers_through_the_pods_port(pod: Agent) -> None:
    """The shared pod (1): its members' own statuses and streams; a call naming no member, an
    unknown one, or carrying no token is refused."""
    assert set(member_pids(pod.proc.pid)) == set(MEMBERS)
    for member in MEMBERS:
        status = pod.call("GetStatus", pb.GetStatusRequest(), metadata=metadata(member))
        assert status.member == member and status.ready
        stream = pod.call("WatchStatus", pb.WatchStatusRequest(), metadata=metadata(member))
        assert next(stream).member == member
        stream.cancel()
    err = pod.refused("GetStatus", pb.GetStatusRequest(), metadata=metadata(None))
    assert err.code() == Code.INVALID_ARGUMENT and MEMBER_KEY in (err.details() or ""), err
    assert all(m in (err.details() or "") for m in MEMBERS), err
    err = pod.refused("GetStatus", pb.GetStatusRequest(), metadata=metadata(f"{POD}-7"))
    assert err.code() == Code.NOT_FOUND and f"{POD}-7" in (err.details() or ""), err
    assert all(m in (err.details() or "") for m in MEMBERS), err
    err = pod.refused("GetStatus", pb.GetStatusRequest(), metadata=metadata(MEMBERS[0], None))
    assert err.code() == Code.UNAUTHENTICATED, err
    err = pod.refused("GetStatus", pb.GetStatusRequest(), metadata=metadata(MEMBERS[0], "wrong"))
    assert err.code() == Code.UNAUTHENTICATED, err
    # A plaintext pod has no certificate to rotate.
    rotate = pb.RotateCertificateRequest(cert=b"x", key=b"y")
    err = pod.refused("RotateCertificate", rotate, metadata=metadata(MEMBERS[0]))
    assert err.code() == Code.FAILED_PRECONDITION and "plaintext" in (err.details() or ""), err
    # The pod's status: every member's in one call that names none; a member that does not
    # answer in time is named with its error, the others' statuses come back.
    whole = pod.call("GetPodStatus", pb.GetStatusRequest(), metadata=metadata(None))
    assert sorted(s.member for s in whole.members) == MEMBERS and not whole.unanswered
    assert all(s.ready for s in whole.members)
    stopped = member_pids(pod.proc.pid)[MEMBERS[1]]
    os.kill(stopped, signal.SIGSTOP)
    try:
        part = pod.call("GetPodStatus", pb.GetStatusRequest(), metadata=metadata(None), timeout=2)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert [s.member for s in part.members] == MEMBERS[:1], part
    assert list(part.unanswered) == MEMBERS[1:], part
    assert part.unanswered[MEMBERS[1]].startswith("DEADLINE_EXCEEDED"), part
    err = pod.refused("GetPodStatus", pb.GetStatusRequest(), metadata=metadata(None, "wrong"))
    assert err.code() == Code.UNAUTHENTICATED, err
    # A member's own refusal comes back as it gave it.
    err = pod.refused("Release", pb.ReleaseRequest(saved=-1), metadata=metadata(MEMBERS[1]))
    assert err.code() == Code.INVALID_ARGUMENT and "saved=-1" in (err.details() or ""), err
    # A command may name several members: it goes to each, and is answered once all took it,
    # else with each one's failure named; a call that is no command names one member only.
    both = (("authorization", f"Bearer {TOKEN}"), *((MEMBER_KEY, m) for m in MEMBERS))
    assert pod.call("Abort", pb.AbortRequest(epoch=1000), metadata=both) == pb.AbortResponse()
    err = pod.refused("Release", pb.ReleaseRequest(saved=-1), metadata=both)
    assert err.code() == Code.INVALID_ARGUMENT, err
    assert all(f"member {m}: INVALID_ARGUMENT" in (err.details() or "") for m in MEMBERS), err
    err = pod.refused("GetStatus", pb.GetStatusRequest(), metadata=both)
    assert err.code() == Code.INVALID_ARGUMENT and "only a command" in (err.details() or ""), err
    twice = (both[0], (MEMBER_KEY, MEMBERS[0]), (MEMBER_KEY, MEMBERS[0]))
    err = pod.refused("Abort", pb.AbortRequest(epoch=1000), metadata=twice)
    assert err.code() == Code.INVALID_ARGUMENT and "once" in (err.details() or ""), err
    # One member that does not answer in time: the answer says so, in time, with the code of a
    # call to send again.
    os.kill(stopped, signal.SIGSTOP)
    try:
        err = pod.refused("Release", pb.ReleaseRequest(saved=-1), metadata=both, timeout=2)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert err.code() == Code.DEADLINE_EXCEEDED, err
    details = err.details() or ""
    assert f"member {MEMBERS[0]}: INVALID_ARGUMENT" in details, err
    assert f"member {MEMBERS[1]}: DEADLINE_EXCEEDED" in details, err


def test_the_pods_metrics_merge_its_members(pod: Agent) -> None:
    """The shared pod (2): /metrics on the pod's port carries both members' series, each
    family once, and parses."""
    url = f"http://{HOST}:{pod.env['LIVESHARD_METRICS_PORT']}/metrics"
    deadline = time.monotonic() + WAIT
    while True:
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        families = list(text_string_to_metric_families(text))
        members = {s.labels.get("member") for f in families for s in f.samples}
        if members >= set(MEMBERS) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert members == set(MEMBERS), text[:2000]
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), types
    phase = next(f for f in families if f.name == "liveshard_member_phase")
    standby = {s.labels["member"] for s in phase.samples if s.labels["phase"] == "standby"}
    assert standby == set(MEMBERS)
    assert all(s.value == 1 for s in phase.samples if s.labels["phase"] == "standby")


def test_the_operator_sees_a_pods_members_in_one_call(pod: Agent) -> None:
    """The shared pod (3): the operator's `observe` over it (the pod object as the API server
    lists it) sees both members with their own statuses; with one stopped, the other still and
    the stopped one not answering, by name."""
    body = pod_body(POD, 2, HOST)
    clients: dict[str, AgentClient] = {}

    def look() -> Observation:
        def no_tls() -> ClientTls:
            raise AssertionError("a plaintext pod needs no certificates")

        return observe(OnePod(body), "ns", "tiny", TOKEN, pod.port, clients, no_tls)  # type: ignore[arg-type]

    try:
        seen = look()
        assert sorted(seen.pods) == MEMBERS
        for member in MEMBERS:
            found = seen.pods[member]
            assert found.pod == POD and found.agent is not None and found.agent.member == member
        stopped = member_pids(pod.proc.pid)[MEMBERS[1]]
        os.kill(stopped, signal.SIGSTOP)
        try:
            part = look()
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert part.pods[MEMBERS[0]].agent is not None
        assert part.pods[MEMBERS[1]].agent is None
        assert part.pods[MEMBERS[1]].error.startswith(f"agent {MEMBERS[1]}: DEADLINE_EXCEEDED")
    finally:
        for client in clients.values():
            client.close()


def test_sigterm_reaches_every_member_and_a_member_that_dies_ends_the_pod(pod: Agent) -> None:
    """The shared pod (4, last): SIGTERM marks both members terminating; a member killed ends
    the pod: the other is killed with it, and the supervisor exits with the dead one's status."""
    pod.signal(signal.SIGTERM)
    for member in MEMBERS:
        route(pod, member)
        pod.wait_for("terminating", lambda s: s.terminating)
    pids = member_pids(pod.proc.pid)
    os.kill(pids[MEMBERS[1]], signal.SIGKILL)
    assert pod.wait_exit() == 128 + signal.SIGKILL, pod.output()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
    assert f"member {MEMBERS[1]} exited with status 137: the pod ends with it" in pod.output()


def test_a_tls_pod_takes_only_the_jobs_client_certificates(tmp_path: Path) -> None:
    """3 processes: a pod serving mutual TLS at its port (its members in plaintext on their
    sockets); both members released, it exits 0."""
    ca = pki.new_authority()
    serving = pki.serving_pair(ca, "tiny", "ns")
    pod = start_pod(
        tmp_path, LIVESHARD_METRICS_PORT=0, LIVESHARD_TLS_CERT=serving.cert.decode(),
        LIVESHARD_TLS_KEY=serving.key.decode(), LIVESHARD_TLS_CA=ca.cert.decode(),
    )  # fmt: skip
    operator = pki.operator_pair(ca)
    address = f"{HOST}:{pod.port}"
    try:
        credentials = grpc.ssl_channel_credentials(ca.cert, operator.key, operator.cert)
        pod.channel = grpc.secure_channel(
            address, credentials, [("grpc.ssl_target_name_override", NAME)]
        )
        pod.stub = pb_grpc.AgentStub(pod.channel)  # type: ignore[no-untyped-call]  # generated
        wait_members_ready(pod)
        with grpc.insecure_channel(address) as plaintext, pytest.raises(grpc.RpcError) as err:
            pb_grpc.AgentStub(plaintext).GetStatus(  # type: ignore[no-untyped-call]
                pb.GetStatusRequest(), timeout=5, metadata=metadata(MEMBERS[0])
            )
        assert err.value.code() == Code.UNAVAILABLE
        for member in MEMBERS:
            status = pod.call("GetStatus", pb.GetStatusRequest(), metadata=metadata(member))
            assert status.member == member
            assert status.serving_certificate == pki.fingerprint(serving.cert)  # the pod's
        # The pod's certificate is rotated by the pod: statuses and new connections show it.
        renewed = pki.serving_pair(ca, "tiny", "ns")
        rotate = pb.RotateCertificateRequest(cert=renewed.cert, key=renewed.key)
        pod.call("RotateCertificate", rotate, metadata=metadata(MEMBERS[0]))
        bad = pb.RotateCertificateRequest(cert=renewed.cert, key=serving.key)
        err = pod.refused("RotateCertificate", bad, metadata=metadata(MEMBERS[1]))
        assert err.code() == Code.INVALID_ARGUMENT, err
        for member in MEMBERS:
            status = pod.call("GetStatus", pb.GetStatusRequest(), metadata=metadata(member))
            assert status.serving_certificate == pki.fingerprint(renewed.cert)
        whole = pod.call("GetPodStatus", pb.GetStatusRequest(), metadata=metadata(None))
        assert {s.serving_certificate for s in whole.members} == {pki.fingerprint(renewed.cert)}
        # A new connection's handshake gets the renewed certificate.
        with socket.create_connection((HOST, pod.port), timeout=10) as raw:
            context = ssl.create_default_context(cadata=ca.cert.decode())
            context.check_hostname = False
            (tmp_path / "op.crt").write_bytes(operator.cert)
            (tmp_path / "op.key").write_bytes(operator.key)
            context.load_cert_chain(tmp_path / "op.crt", tmp_path / "op.key")
            with context.wrap_socket(raw) as tls:
                served = tls.getpeercert(binary_form=True)
        assert served == ssl.PEM_cert_to_DER_cert(renewed.cert.decode())
        for member in MEMBERS:
            pod.call("Release", pb.ReleaseRequest(), metadata=metadata(member))
        assert pod.wait_exit() == 0, pod.output()
    finally:
        close(pod)


@pytest.mark.parametrize("count", ["0", "x", "-2"])
def test_a_bad_member_count_exits_2_with_one_line(count: str) -> None:
    """1 process, which exits before starting any member."""
    env = agent_env(POD, 7070, LIVESHARD_POD_MEMBERS=count)
    done = subprocess.run([AGENT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"liveshard-agent: LIVESHARD_POD_MEMBERS: {count!r}"), done.stderr


def test_the_members_configuration() -> None:
    """No process: each member's environment, and the variables that configure it."""
    environ = agent_env(POD, 7070, LIVESHARD_POD_MEMBERS=2, CUDA_VISIBLE_DEVICES="4,5",
                        **dict.fromkeys(TLS_VARIABLES, "pem"))  # fmt: skip
    member = PodMember(f"{POD}-1", "unix:/tmp/x/member-1.sock", 9402)
    env = member_env(environ, member, 1, 2)
    assert not set(TLS_VARIABLES) & set(env) and "LIVESHARD_POD_MEMBERS" not in env
    assert (env["LIVESHARD_MEMBER"], env["LIVESHARD_LISTEN"]) == (member.name, member.address)
    assert (env["LIVESHARD_METRICS_HOST"], env["LIVESHARD_METRICS_PORT"]) == ("127.0.0.1", "9402")
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["LIVESHARD_POD_IP"] == HOST
    one_gpu = member_env({**environ, "CUDA_VISIBLE_DEVICES": "3"}, member, 1, 2)
    assert one_gpu["CUDA_VISIBLE_DEVICES"] == "3"  # fewer GPUs than members: left as it is
    unset = {k: v for k, v in environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    assert member_env(unset, member, 1, 2)["CUDA_VISIBLE_DEVICES"] == "1"  # the container's own

    config = load(member_env(agent_env(POD, 7070), member, 1, 2), [])
    assert (config.address, config.metrics_host, config.pod_members) == (
        member.address, "127.0.0.1", 1
    )  # fmt: skip
    assert load(agent_env(POD, 7070), []).metrics_host == HOST  # the pod IP unless set
    for overrides, line in [
        ({"LIVESHARD_LISTEN": "10.0.0.1:7070"}, "LIVESHARD_LISTEN: '10.0.0.1:7070' must be"),
        ({"LIVESHARD_METRICS_HOST": "here"}, "LIVESHARD_METRICS_HOST: 'here' is not an IP"),
        ({"LIVESHARD_POD_MEMBERS": "8", "LIVESHARD_METRICS_PORT": "7065"},
         "LIVESHARD_METRICS_PORT: the pod's 8 members serve their metrics on ports 7066..7073"),
        ({"LIVESHARD_POD_MEMBERS": "8", "LIVESHARD_METRICS_PORT": "65530"},
         "LIVESHARD_METRICS_PORT: the pod's 8 members"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"^{line}"):
            load(agent_env(POD, 7070, **overrides), [])
