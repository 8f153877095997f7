"""The API of one agent, over real gRPC: status and readiness, the token, garbage and malformed
requests, state conflicts. Every test here shares one standing-by agent process (the module's
fixture); each checks afterwards that the agent still serves and that nothing changed."""

from __future__ import annotations

import contextlib
import json
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("torch", reason="the agent needs torch (the agent extra)")

from liveshard.v1 import agent_pb2 as pb

from .agents import HOST, TOKEN, Agent, Phase, agents, layout

Code = grpc.StatusCode
STORE = pb.StoreAddress(host=HOST, port=1)  # never reached: every request here is refused


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    with agents(["a0"], tmp_path_factory.mktemp("agents"), LIVESHARD_LOG_FORMAT="json") as started:
        yield started["a0"]


def standing_by(agent: Agent) -> None:
    """The agent answers and is as it started: ready, standing by, in no world, nothing pending."""
    status = agent.status()
    assert agent.proc.poll() is None
    assert (status.phase, status.ready, status.epoch) == (Phase.STANDBY, True, -1)
    assert not status.HasField("pending") and not status.HasField("layout")
    assert not status.HasField("last_switch") and status.message == ""


def first_world(**fields: Any) -> pb.PrepareRequest:
    values: dict[str, Any] = {"epoch": 0, "store": STORE, "to": layout(["a0"])}
    values.update(fields)
    return pb.PrepareRequest(**{k: v for k, v in values.items() if v is not None})


def test_status_and_readiness(agent: Agent) -> None:
    """The shared agent process (1): ready, standing by, its stream starts with its status."""
    status = agent.status()
    assert status.member == "a0" and status.ready and status.phase == Phase.STANDBY
    assert status.epoch == -1 and status.steps == 100_000 and not status.terminating
    standing_by(agent)
    # The stream starts with the status as it is.
    stream = agent.call("WatchStatus", pb.WatchStatusRequest())
    assert next(stream) == agent.status()
    stream.cancel()


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer wrong"),),
        (("authorization", f"Basic {TOKEN}"),),
        (("authorization", TOKEN),),
        (("authorization", f"Bearer {TOKEN}x"),),
        (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")),
    ],
    ids=["none", "wrong", "other scheme", "no scheme", "longer", "twice"],
)
def test_calls_without_the_token_are_refused_and_change_nothing(
    agent: Agent, metadata: tuple[tuple[str, str], ...]
) -> None:
    """The shared agent process (1): every call without a valid token ends UNAUTHENTICATED."""
    calls = [
        ("GetStatus", pb.GetStatusRequest()),
        ("GetPodStatus", pb.GetStatusRequest()),
        ("HostStore", pb.HostStoreRequest(epoch=0)),
        ("Prepare", first_world()),
        ("Checkpoint", pb.CheckpointRequest(number=1, path="/tmp/x")),
        ("Release", pb.ReleaseRequest()),
    ]
    for method, request in calls:
        err = agent.refused(method, request, metadata=metadata)
        assert err.code() == Code.UNAUTHENTICATED, (method, err)
    with pytest.raises(grpc.RpcError) as refused:
        next(agent.call("WatchStatus", pb.WatchStatusRequest(), metadata=metadata))
    assert refused.value.code() == Code.UNAUTHENTICATED
    standing_by(agent)  # Release did not end it, Prepare did not start anything


def raw_call(agent: Agent, method: str, payload: bytes) -> grpc.RpcError | None:
    call = agent.channel.unary_unary(f"/liveshard.v1.Agent/{method}")  # bytes as they are
    try:
        call(payload, metadata=agent.metadata, timeout=10)
    except grpc.RpcError as err:
        return err
    return None


METHODS = ["GetStatus", "HostStore", "Prepare", "Switch", "Abort", "Checkpoint", "Release"]


def test_garbage_gets_an_error_and_the_agent_keeps_serving(agent: Agent) -> None:
    """The shared agent process (1), fed bytes that are no request."""
    # Bytes that are not HTTP/2 at all, straight onto the port.
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", random.randbytes(4096)):
        with socket.create_connection((HOST, agent.port), timeout=5) as sock:
            sock.sendall(payload)
            sock.settimeout(5)
            with contextlib.suppress(OSError):
                sock.recv(1024)  # whatever it answers before it closes
    # Bytes that are no message of the method, inside well-formed calls.
    for method in METHODS:
        err = raw_call(agent, method, b"\xff\xff\xff\xff")
        assert err is not None and err.code() == Code.INVALID_ARGUMENT, (method, err)
        assert f"not a valid liveshard.v1.{method}Request" in (err.details() or "")
    # Random bytes: whatever they decode to, an error or a harmless answer, never a crash.
    rng = random.Random(7)
    for _ in range(40):
        method = rng.choice([m for m in METHODS if m not in ("HostStore", "Release")])
        err = raw_call(agent, method, rng.randbytes(rng.randrange(1, 300)))
        assert err is None or err.code() in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION)
    # A message of another method (a CheckpointRequest's fields read as a SwitchRequest's).
    err = raw_call(agent, "Prepare", pb.SwitchRequest(epoch=3, at_step=5).SerializeToString())
    assert err is not None and err.code() == Code.INVALID_ARGUMENT and "to: required" in str(err)
    err = raw_call(agent, "NoSuchMethod", b"")
    assert err is not None and err.code() == Code.UNIMPLEMENTED
    err = raw_call(agent, "GetPodStatus", b"\xff\xff\xff\xff")
    assert err is not None and err.code() == Code.INVALID_ARGUMENT, err
    # A lone agent's pod holds only it.
    pod = agent.call("GetPodStatus", pb.GetStatusRequest())
    assert [s.member for s in pod.members] == [agent.member] and not pod.unanswered
    standing_by(agent)


BAD_PREPARES = [
    # (fields of a first world's PrepareRequest, code, words of the message)
    ({"to": None}, Code.INVALID_ARGUMENT, "to: required"),
    ({"store": None}, Code.INVALID_ARGUMENT, "store: required"),
    ({"store": pb.StoreAddress(host=HOST, port=0)}, Code.INVALID_ARGUMENT, "store.port=0"),
    ({"store": pb.StoreAddress(port=5)}, Code.INVALID_ARGUMENT, "store.host=''"),
    ({"epoch": -1}, Code.INVALID_ARGUMENT, "epoch=-1 must be >= 0"),
    ({"to": layout(["a0", "a1", "a2"], tp=3)}, Code.INVALID_ARGUMENT,
     "to: tp=3 must divide heads=4 of qwen3-tiny"),
    ({"to": layout(["a0", "a1", "a2"], dp=3)}, Code.INVALID_ARGUMENT,
     "to.dp: global batch 4 does not divide into dp=3"),
    ({"to": layout(["a0", "a1"])}, Code.INVALID_ARGUMENT, "to: 2 members given, but dp*tp*pp = 1"),
    ({"to": layout(["a0", "a0"], dp=2)}, Code.INVALID_ARGUMENT, "a member appears twice"),
    ({"to": layout([""])}, Code.INVALID_ARGUMENT, "to.members[0]=''"),
    ({"to": layout(["a0", "a 1"], dp=2)}, Code.INVALID_ARGUMENT, "to.members[1]='a 1' must be"),
    ({"to": layout(["a0", "a\x01"], dp=2)}, Code.INVALID_ARGUMENT, "to.members[1]='a\\x01'"),
    ({"to": layout(["a0", "a" * 254], dp=2)}, Code.INVALID_ARGUMENT, "to.members[1]='aaa"),
    ({"to": layout(["a0"], dp=0)}, Code.INVALID_ARGUMENT, "to: dp=0 must be an integer >= 1"),
    ({"to": layout(["a0"], zero=2)}, Code.INVALID_ARGUMENT, "to: zero=2 must be one of"),
    ({"to": layout(["a0", "a1"], pp=2, pp_layers=[1, 1])}, Code.INVALID_ARGUMENT,
     "to: pp_layers=[1, 1] sums to 2"),
    ({"to": layout(["a1"])}, Code.INVALID_ARGUMENT, "to.members: this agent, 'a0', is not"),
    ({"at_step": -2}, Code.INVALID_ARGUMENT, "at_step=-2 must be >= -1"),
    ({"at_step": 5}, Code.INVALID_ARGUMENT, "at_step=5: a first world starts"),
    ({"lost": ["a1"]}, Code.INVALID_ARGUMENT, "lost: only a reconfiguration"),
    ({"budget_bytes": -1}, Code.INVALID_ARGUMENT, "budget_bytes=-1"),
    ({"deadlines": pb.Deadlines(op_seconds=-1)}, Code.INVALID_ARGUMENT,
     "deadlines.op_seconds=-1.0 must be in [0, 21600] seconds"),
    ({"deadlines": pb.Deadlines(prepare_seconds=1e9)}, Code.INVALID_ARGUMENT,
     "deadlines.prepare_seconds=1000000000.0 must be in [0, 21600] seconds"),
    ({"deadlines": pb.Deadlines(op_seconds=100, switch_seconds=10)}, Code.INVALID_ARGUMENT,
     "deadlines: op=100.0 <= switch=10.0"),
    ({"restore_from": "ckpt"}, Code.INVALID_ARGUMENT, "restore_from='ckpt' must be an absolute"),
    ({"restore_from": "/nonexistent/ckpt"}, Code.INVALID_ARGUMENT,
     "restore_from: no liveshard checkpoint at /nonexistent/ckpt"),
    # Reconfigurations (with `from`) this standing-by agent cannot take.
    ({"from": layout(["a0"]), "to": layout(["a1"])}, Code.INVALID_ARGUMENT,
     "from.members: this agent, 'a0', trains in no world here"),
    ({"from": layout(["a1"]), "to": layout(["a2"])}, Code.INVALID_ARGUMENT,
     "this agent, 'a0', is a member of neither"),
    ({"from": layout(["a1", "a2"], dp=2), "to": layout(["a0", "a1"], dp=2), "lost": ["a3"]},
     Code.INVALID_ARGUMENT, "lost[0]='a3' must be a member of `from`"),
    ({"from": layout(["a1", "a2"], dp=2), "to": layout(["a0", "a1"], dp=2), "pods": {"a3": "p"}},
     Code.INVALID_ARGUMENT, "pods['a3']: 'a3' is a member of neither `from` nor `to`"),
    ({"from": layout(["a1", "a2"], dp=2), "to": layout(["a0", "a1"], dp=2), "pods": {"a1": ""}},
     Code.INVALID_ARGUMENT, "pods['a1'] is empty"),
    ({"from": layout(["a1", "a2"], dp=2), "to": layout(["a0", "a1"], dp=2),
      "pods": {"a3": "p", "a1": ""}}, Code.INVALID_ARGUMENT, "pods['a1'] is empty"),
    ({"from": layout(["a1"]), "to": layout(["a0"]), "restore_from": "/x"},
     Code.INVALID_ARGUMENT, "restore_from: only the job's first world"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "code", "words"), BAD_PREPARES)
def test_malformed_and_contradictory_prepares_are_refused(
    agent: Agent, fields: dict[str, Any], code: grpc.StatusCode, words: str
) -> None:
    """The shared agent process (1): each bad Prepare gets its code, naming the field."""
    err = agent.refused("Prepare", first_world(**fields))
    assert err.code() == code and words in (err.details() or ""), err
    standing_by(agent)


def test_other_calls_check_their_fields_and_the_agents_state(agent: Agent) -> None:
    """The shared agent process (1): Switch, Abort, Checkpoint, HostStore, Release and
    RotateCertificate refusals."""
    cases = [
        ("Switch", pb.SwitchRequest(epoch=1, at_step=-1), Code.INVALID_ARGUMENT, "at_step=-1"),
        ("Switch", pb.SwitchRequest(epoch=1), Code.FAILED_PRECONDITION, "epoch 1 is not pending"),
        ("Abort", pb.AbortRequest(epoch=-3), Code.INVALID_ARGUMENT, "epoch=-3"),
        ("Checkpoint", pb.CheckpointRequest(number=1, path="ckpt"), Code.INVALID_ARGUMENT,
         "path='ckpt' must be an absolute path"),
        ("Checkpoint", pb.CheckpointRequest(number=-1, path="/c"), Code.INVALID_ARGUMENT,
         "number=-1"),
        ("Checkpoint", pb.CheckpointRequest(number=1, path="/c", export_to="hf"),
         Code.INVALID_ARGUMENT, "export_to='hf' must be empty or an absolute path"),
        ("Checkpoint", pb.CheckpointRequest(number=1, path="/c"), Code.FAILED_PRECONDITION,
         "this agent is STANDBY: only members of the world in effect"),
        ("HostStore", pb.HostStoreRequest(epoch=-1), Code.INVALID_ARGUMENT, "epoch=-1"),
        ("Release", pb.ReleaseRequest(saved=-1), Code.INVALID_ARGUMENT, "saved=-1"),
        ("RotateCertificate", pb.RotateCertificateRequest(cert=b"x", key=b"y"),
         Code.FAILED_PRECONDITION, "serves its API in plaintext"),
    ]  # fmt: skip
    for method, request, code, words in cases:
        err = agent.refused(method, request)
        assert err.code() == code and words in (err.details() or ""), (method, err)
    # Nothing pending: aborting an epoch that never came is already done.
    agent.call("Abort", pb.AbortRequest(epoch=4))
    standing_by(agent)


def test_stores_of_epochs_no_one_will_use_are_freed(agent: Agent) -> None:
    """The shared agent process (1): a store hosted for each of 50 epochs that never came
    leaves the process with the descriptors of one, not 50 (about 9 each when kept)."""
    fds = Path(f"/proc/{agent.proc.pid}/fd")
    agent.call("HostStore", pb.HostStoreRequest(epoch=1000))
    before = len(list(fds.iterdir()))
    for epoch in range(1001, 1051):
        assert agent.call("HostStore", pb.HostStoreRequest(epoch=epoch)).address.port > 0
    assert len(list(fds.iterdir())) <= before + 10, sorted(p.name for p in fds.iterdir())
    standing_by(agent)
    # Its log (LIVESHARD_LOG_FORMAT=json) says so, one JSON object per line with its context.
    lines = [json.loads(line) for line in agent.output().splitlines() if line.startswith("{")]
    freed = [line for line in lines if line["message"].endswith("freed the store of epoch 1049")]
    assert freed and freed[0]["level"] == "INFO" and freed[0]["member"] == "a0", lines[-3:]


def test_a_prepare_is_checked_against_the_model_from_the_configuration(
    tmp_path: Path, agent: Agent
) -> None:
    """The shared agent process (1): a checkpoint of another model is refused before anything
    starts."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "liveshard.json").write_text('{"model_digest": "0", "model": {"name": "x"}}')
    err = agent.refused("Prepare", first_world(restore_from=str(directory)))
    assert err.code() == Code.INVALID_ARGUMENT and "holds model 'x'" in (err.details() or "")
    standing_by(agent)


def test_a_restore_from_what_is_no_whole_checkpoint_is_refused_naming_it(
    tmp_path: Path, agent: Agent
) -> None:
    """The shared agent process (1): a directory without liveshard.json (a save that never
    finished), one whose liveshard.json cannot be read, and a regular file are refused at the
    request, each named with what is wrong; the agent stands by as before."""
    partial, garbled, afile = tmp_path / "partial", tmp_path / "garbled", tmp_path / "afile"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")
    garbled.mkdir()
    (garbled / "liveshard.json").write_text('{"model_digest": ')
    afile.write_text("")
    cases = [
        (partial, "restore_from: no liveshard checkpoint at {}: liveshard.json: No such file"),
        (garbled, "restore_from: checkpoint {}: liveshard.json cannot be read: JSONDecodeError"),
        (afile, "restore_from: no liveshard checkpoint at {}: not a directory"),
    ]
    for path, words in cases:
        err = agent.refused("Prepare", first_world(restore_from=str(path)))
        assert err.code() == Code.INVALID_ARGUMENT, err
        assert words.format(path) in (err.details() or ""), err
    standing_by(agent)
