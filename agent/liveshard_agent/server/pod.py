"""The supervisor of a worker pod of several members: one agent per member, one endpoint per pod.

A pod may hold several members (one per GPU). With LIVESHARD_POD_MEMBERS=N from 2,
`liveshard-agent` starts N agents as child processes instead of being one. Member k is named
`<pod>-k` and is a whole agent: it serves its API in plaintext on a Unix socket in a folder only
this pod's user can enter (LIVESHARD_LISTEN), its metrics on 127.0.0.1 at the pod's metrics port
+ 1 + k, gets the k-th of the pod's GPUs (`member_env`), and hosts stores and process groups on
the pod IP, as a pod's lone agent does. The supervisor serves:

- the `liveshard.v1.Agent` API on the pod's address, behind the same mutual TLS and token check
  as an agent's (`certs`, `auth`), as a proxy: the metadata key `liveshard-member` names the
  member a call is for; the request's bytes, the caller's metadata and its remaining deadline go
  to that member's agent unparsed, and its answer or status comes back as it is (an UNAVAILABLE
  with the member's name in front: it may be that the member does not answer); a command (a
  method whose answer carries nothing: Prepare, Switch, Abort, Checkpoint, Release) may name
  several of the pod's members, each in a `liveshard-member` entry: it goes to all of them at
  once, and is answered when every one took it, else with each failure named (the code of one
  that may answer later if any, so that the caller sends it again soon); but the
  certificate is the pod's: `RotateCertificate` is answered here, and the members' statuses
  carry its fingerprint; and `GetPodStatus`, which names no member, is answered here with every
  member's status, asked of all at once (the operator's one call a pass for the pod);
- `/metrics` on the pod's metrics port: its members' expositions merged family by family.

SIGTERM is passed on to every member (each reports `terminating` and serves until released). The
supervisor exits once every member has: 0 if all exited 0 (each was released), else the first
non-zero status. A member that fails (exits non-zero: it crashed or was killed) ends the pod: the
others are killed, and the pod's members are lost and replaced together, as they join and leave.
Members log to the pod's own stdout and stderr, so the kubelet's termination message (the log's
last lines) is theirs.

This module must not import torch (the supervisor starts in a moment; its members import it) nor
hold agent logic: every call is answered by the member it names.
"""

from __future__ import annotations

import logging
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from liveshard.codes import MAY_ANSWER_LATER
from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput
from liveshard_core.job import MEMBER_KEY

from ..engine.record import context_logger
from . import listen
from .certs import ServingCertificate
from .config import TLS_VARIABLES, AgentConfig
from .errors import Refused, status_of

log = logging.getLogger(__name__)

MEMBERS_HOST = "127.0.0.1"  # where the members serve their metrics: inside the pod only
_SERVICE = pb.DESCRIPTOR.services_by_name["Agent"]
_GET_STATUS = f"/{_SERVICE.full_name}/GetStatus"
_GET_POD_STATUS = f"/{_SERVICE.full_name}/GetPodStatus"
_ROTATE = f"/{_SERVICE.full_name}/RotateCertificate"
# An agent serves 16 watchers and 16 more calls at once; the proxy holds a thread for each call
# it forwards.
_CALLS_PER_MEMBER = 32
# A member's socket appears once its agent has imported torch: retry it often, not grpc's
# default backoff of up to two minutes.
_CHANNEL_OPTIONS = [("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
# grpc gives a call without a deadline some 2**63 seconds; forwarded, that overflows.
_NO_DEADLINE = 1e8
# Seconds of a call's deadline the proxy keeps from its members' calls when it asks several
# (GetPodStatus, a command for several), to answer in time with what came and what did not (a
# quarter of it when it is shorter).
_ANSWER_MARGIN = 0.25
_METRICS_TIMEOUT = 2.0  # seconds a member has to answer for its metrics
_STOP_GRACE = 5.0  # seconds for calls in flight when the proxy stops
_SERVED_POLL = 0.1  # seconds between looks for the members' sockets


@dataclass(frozen=True)
class PodMember:
    """One member of the pod: its name, its API's address and its metrics' port (0: none)."""

    name: str
    address: str
    metrics_port: int


def pod_members(config: AgentConfig, folder: Path) -> list[PodMember]:
    """The pod's members, their sockets in `folder`."""
    return [
        PodMember(
            f"{config.member}-{k}",
            f"unix:{folder / f'member-{k}.sock'}",
            config.metrics_port + 1 + k if config.metrics_port else 0,
        )
        for k in range(config.pod_members)
    ]


def member_env(environ: Mapping[str, str], member: PodMember, k: int, count: int) -> dict[str, str]:
    """The environment of member `k` of `count`: the pod's, less its TLS material (a member's
    API is reached through the supervisor only) and member count, with the k-th GPU: of
    CUDA_VISIBLE_DEVICES when it lists one for each member, else, when it is not set, the
    container's k-th (a device plugin shows a container its own GPUs only, from 0)."""
    dropped = {*TLS_VARIABLES, "LIVESHARD_POD_MEMBERS"}
    env = {key: value for key, value in environ.items() if key not in dropped}
    env.update(
        LIVESHARD_MEMBER=member.name, LIVESHARD_LISTEN=member.address,
        LIVESHARD_METRICS_HOST=MEMBERS_HOST, LIVESHARD_METRICS_PORT=str(member.metrics_port),
    )  # fmt: skip
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if len(devices) >= count:
        env["CUDA_VISIBLE_DEVICES"] = devices[k]
    elif visible is None:  # the container sees its own GPUs only, numbered from 0 (a device plugin)
        env["CUDA_VISIBLE_DEVICES"] = str(k)
    return env


class Proxy(grpc.GenericRpcHandler):
    """The Agent service's methods, each forwarded to the member its call names; but the pod's
    certificate is the pod's own: `RotateCertificate` is answered here, and the statuses the
    members send carry its fingerprint (what the operator compares to renew it)."""

    def __init__(self, members: list[PodMember], serving: ServingCertificate | None) -> None:
        self._channels = {
            m.name: grpc.insecure_channel(m.address, _CHANNEL_OPTIONS) for m in members
        }
        self._serving = serving
        self._streaming = {
            f"/{_SERVICE.full_name}/{method.name}": method.server_streaming
            for method in _SERVICE.methods
        }
        # The commands: their answer carries nothing, so one call may be for several members.
        self._commands = {
            f"/{_SERVICE.full_name}/{method.name}"
            for method in _SERVICE.methods
            if not method.server_streaming and not method.output_type.fields
        }

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        streaming = self._streaming.get(details.method)
        if streaming is None:
            return None  # UNIMPLEMENTED
        if details.method == _ROTATE:
            return grpc.unary_unary_rpc_method_handler(self._rotate)
        if details.method == _GET_POD_STATUS:
            return grpc.unary_unary_rpc_method_handler(self._pod_status)
        if streaming:
            return grpc.unary_stream_rpc_method_handler(partial(self._stream, details.method))
        return grpc.unary_unary_rpc_method_handler(partial(self._unary, details.method))

    def _unary(self, method: str, raw: bytes, context: grpc.ServicerContext) -> bytes:
        names = self._names(context)
        if len(names) > 1 and method in self._commands:
            return self._to_each(method, names, raw, context)
        member, channel = self._route(names, context)
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
        try:
            answer = bytes(call(raw, timeout=_remaining(context), metadata=_metadata(context)))
        except grpc.RpcError as err:
            _pass_on(err, member, context)
        return self._stamped(answer) if method == _GET_STATUS else answer

    def _stream(self, method: str, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        member, channel = self._route(self._names(context), context)
        call: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(method)
        answers = call(raw, timeout=_remaining(context), metadata=_metadata(context))

        def cancel() -> None:  # the caller gone (or the stream over): the member's ends too
            answers.cancel()

        context.add_callback(cancel)
        try:
            yield from (self._stamped(answer) for answer in answers)
        except grpc.RpcError as err:
            if context.is_active():
                _pass_on(err, member, context)

    def _to_each(
        self, method: str, names: list[str], raw: bytes, context: grpc.ServicerContext
    ) -> bytes:
        """A command for several members (`_ask_each`): their answer when every one took it."""
        answers = self._ask_each(method, names, raw, context)
        failed = {n: a for n, a in answers.items() if isinstance(a, grpc.RpcError)}
        if failed:
            codes = [err.code() for err in failed.values()]
            # one member that may take it later makes the caller send it again soon
            code = next((c for c in codes if c in MAY_ANSWER_LATER), codes[0])
            context.abort(code, "; ".join(
                f"member {name}: {err.code().name}: {err.details() or ''}"
                for name, err in failed.items()
            ))  # fmt: skip
        return next(a for a in answers.values() if isinstance(a, bytes))

    def _pod_status(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """Every member's `GetStatus` (`_ask_each`); a member whose call fails is named with its
        error."""
        try:
            pb.GetStatusRequest.FromString(raw)
        except Exception as err:  # protobuf's DecodeError
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {err}")
        pod = pb.PodStatus()
        for name, answer in self._ask_each(_GET_STATUS, list(self._channels), raw, context).items():
            if isinstance(answer, grpc.RpcError):
                pod.unanswered[name] = f"{answer.code().name}: {answer.details() or ''}"
            else:
                pod.members.append(pb.AgentStatus.FromString(self._stamped(answer)))
        return bytes(pod.SerializeToString())

    def _ask_each(
        self, method: str, names: list[str], raw: bytes, context: grpc.ServicerContext
    ) -> dict[str, bytes | grpc.RpcError]:
        """`raw` to each of the members `names` at once, with the caller's metadata (each call
        naming its member) and deadline less `_ANSWER_MARGIN`; each one's answer or error."""
        timeout = _kept_back(context)
        metadata = tuple((k, v) for k, v in _metadata(context) if k != MEMBER_KEY)
        calls = {}
        for name in names:
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channels[name].unary_unary(
                method
            )
            calls[name] = call.future(
                raw, timeout=timeout, metadata=(*metadata, (MEMBER_KEY, name))
            )
        answers: dict[str, bytes | grpc.RpcError] = {}
        for name, future in calls.items():
            try:
                answers[name] = bytes(future.result())
            except grpc.RpcError as err:
                answers[name] = err
        return answers

    def _stamped(self, raw: bytes) -> bytes:
        """A member's status with the pod's certificate in it (none in plaintext)."""
        if self._serving is None:
            return raw
        status = pb.AgentStatus.FromString(raw)
        status.serving_certificate = self._serving.fingerprint
        return bytes(status.SerializeToString())

    def _rotate(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """Serve the pair `raw` names to new connections (the agent's `rotate_certificate`)."""
        try:
            request = pb.RotateCertificateRequest.FromString(raw)
        except Exception as err:  # protobuf's DecodeError
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {err}")
        try:
            if self._serving is None:
                raise Refused("this pod serves its API in plaintext: it has no certificate")
            served = self._serving.replace(request.cert, request.key, request.ca)
        except (InvalidInput, Refused) as err:  # as an agent's: the one table of `errors`
            context.abort(*status_of(err))
        log.info("the pod's serving certificate rotated: new connections get %s", served[:16])
        return bytes(pb.RotateCertificateResponse().SerializeToString())

    def _route(self, names: list[str], context: grpc.ServicerContext) -> tuple[str, grpc.Channel]:
        """The one member a call names (`_names`), and its channel."""
        if len(names) != 1:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{MEMBER_KEY}: one required, naming the member the call is for (only a "
                f"command may name several; this pod's members: {', '.join(self._channels)})",
            )
        return names[0], self._channels[names[0]]

    def _names(self, context: grpc.ServicerContext) -> list[str]:
        """The members a call names: at least one, each of this pod, none twice."""
        names = [str(v) for k, v in context.invocation_metadata() or () if k == MEMBER_KEY]
        members = ", ".join(self._channels)
        if not names or len(set(names)) != len(names):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{MEMBER_KEY}: required, naming each member the call is for once "
                f"(this pod's: {members})",
            )
        for name in names:
            if name not in self._channels:
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"{MEMBER_KEY}: no member {name!r} in this pod (its members: {members})",
                )
        return names

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _metadata(context: grpc.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((key, value) for key, value in context.invocation_metadata() or ())


def _remaining(context: grpc.ServicerContext) -> float | None:
    seconds = context.time_remaining()
    return None if seconds is None or seconds > _NO_DEADLINE else seconds


def _kept_back(context: grpc.ServicerContext) -> float | None:
    """The deadline of the calls to several members: the caller's, less `_ANSWER_MARGIN`."""
    seconds = _remaining(context)
    return None if seconds is None else seconds - min(_ANSWER_MARGIN, seconds / 4)


def _pass_on(err: grpc.RpcError, member: str, context: grpc.ServicerContext) -> NoReturn:
    code, details = err.code(), err.details() or ""
    if code is grpc.StatusCode.UNAVAILABLE:
        details = f"member {member}: {details}"
    context.abort(code, details)


class MergedMetrics:
    """A collector of the members' expositions, fetched at each scrape; a member that does not
    answer in time is left out of that scrape."""

    def __init__(self, urls: list[str]) -> None:
        self._urls = urls

    def collect(self) -> Iterable[Metric]:
        with ThreadPoolExecutor(len(self._urls)) as pool:
            texts = list(pool.map(_fetch, self._urls))
        families: dict[str, Metric] = {}
        for text in texts:
            for family in text_string_to_metric_families(text):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return families.values()


def _fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=_METRICS_TIMEOUT) as answer:
            return str(answer.read().decode())
    except OSError as err:  # not serving yet, gone, or too slow
        log.debug("no metrics from %s: %s", url, err)
        return ""


class Front:
    """A pod's side of its members: the folder of their sockets (mode 0700), each member's place
    (`members`) and environment (`environs`, from the pod's `environ`), and the `proxy` that
    routes the pod's calls to them once `serve` opens the pod's address. `close` frees it all
    but the server."""

    def __init__(self, config: AgentConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        self.folder = Path(tempfile.mkdtemp(prefix="liveshard-"))
        self.members = pod_members(config, self.folder)
        count = len(self.members)
        self.environs = [member_env(environ, m, k, count) for k, m in enumerate(self.members)]
        self.tls = ServingCertificate(config.tls) if config.tls is not None else None
        self.proxy = Proxy(self.members, self.tls)

    def serve(self) -> grpc.Server:
        """The proxy on the pod's address, served as an agent's API is; RuntimeError if the
        address cannot be bound."""
        threads = _CALLS_PER_MEMBER * len(self.members)
        return listen.serve(self.proxy, self.config.token, self.config.address, self.tls, threads,
                            "pod-rpc")  # fmt: skip

    def close(self) -> None:
        self.proxy.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _serve_metrics(
    config: AgentConfig, members: list[PodMember], logger: logging.LoggerAdapter[logging.Logger]
) -> WSGIServer | None:
    """The members' metrics merged, on the pod's metrics port (`listen.serve_metrics`)."""
    registry = CollectorRegistry()
    registry.register(
        MergedMetrics([f"http://{MEMBERS_HOST}:{m.metrics_port}/metrics" for m in members])
    )
    return listen.serve_metrics(registry, config, logger)


def _command(member: PodMember, argv: list[str]) -> list[str]:
    """This installation's `liveshard-agent` with the pod's flags, the member's own last (the
    last of a flag wins)."""
    script = Path(sys.executable).parent / "liveshard-agent"
    agent = [str(script)] if script.exists() else [sys.executable, "-m", __package__ + ".main"]
    return [*agent, *argv, "--member", member.name, "--metrics-port", str(member.metrics_port)]


def _pass_sigterm(children: list[subprocess.Popen[bytes]]) -> None:
    """Wait for SIGTERM (blocked on every other thread, as in an agent) and send it on."""
    while True:
        signal.sigwait({signal.SIGTERM})
        log.warning("SIGTERM: passed on to the pod's %s members", len(children))
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)


def supervise(config: AgentConfig, environ: Mapping[str, str], argv: list[str]) -> int:
    """Run the pod's members until every one has exited; the pod's exit status."""
    logger = context_logger(log, job=config.job, epoch=-1, member=config.member)
    front = Front(config, environ)
    members = front.members
    children: list[subprocess.Popen[bytes]] = []
    try:
        for member, env in zip(members, front.environs, strict=True):
            children.append(subprocess.Popen(_command(member, argv), env=env))
        threading.Thread(
            target=_pass_sigterm, args=(children,), name="sigterm", daemon=True
        ).start()
        # The pod's port opens once every member serves, as a one-member pod's opens once its
        # agent does: a readiness probe on it then says the pod's members answer.
        server = None
        if _until_served(members, children):
            try:
                server = front.serve()
            except RuntimeError as err:  # grpc's: the address is not this host's, or port taken
                logger.error("cannot serve on %s: %s", config.address, err)
                return 1
            logger.info("serving the pod's members %s on %s",
                        ", ".join(m.name for m in members), config.address)  # fmt: skip
        metrics_server = _serve_metrics(config, members, logger)
        status = _wait(members, children, logger)
        if server is not None:
            server.stop(_STOP_GRACE).wait()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        for child in children:  # only when the supervisor itself failed: no member outlives it
            if child.poll() is None:
                child.kill()
                child.wait()
        front.close()


def _until_served(members: list[PodMember], children: list[subprocess.Popen[bytes]]) -> bool:
    """Wait until every member's socket is there (its agent serves); False as soon as a member
    has exited (the pod ends with it)."""
    sockets = [Path(m.address.removeprefix("unix:")) for m in members]
    while not all(socket.exists() for socket in sockets):
        if any(child.poll() is not None for child in children):
            return False
        time.sleep(_SERVED_POLL)
    return True


def _wait(
    members: list[PodMember],
    children: list[subprocess.Popen[bytes]],
    logger: logging.LoggerAdapter[logging.Logger],
) -> int:
    """Once every child has exited: 0 if all exited 0 (each was released), else the first
    non-zero status (a signal's as a shell reports it, 128 + its number). A member that fails
    ends the pod: the others are killed at once, so that the operator sees every member of the
    pod lost together and recovers them in one reconfiguration."""
    exits: queue.Queue[tuple[str, int]] = queue.Queue()
    for member, child in zip(members, children, strict=True):
        threading.Thread(
            target=lambda m=member.name, c=child: exits.put((m, c.wait())), daemon=True
        ).start()
    status = 0
    for _ in children:
        name, code = exits.get()
        code = code if code >= 0 else 128 - code
        if code and not status:
            logger.warning("member %s exited with status %s: the pod ends with it", name, code)
            for child in children:
                if child.poll() is None:
                    child.kill()
        elif not code:
            logger.info("member %s exited", name)
        status = status or code
    return status
