"""The gRPC server: `liveshard.v1.Agent`'s methods bound to the service, behind mutual TLS (when
configured) and the token check.

Handlers take the request's raw bytes and parse them themselves, so bytes that are no valid
message end with INVALID_ARGUMENT naming the expected message, rather than grpc's own INTERNAL.
Every error a handler raises goes through the one table (`errors.status_of`); nothing a caller
sends can end the process. This module must not decide what a request means.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput

from .auth import TokenAuth
from .certs import ServingCertificate
from .errors import status_of
from .service import WATCH_LIMIT, AgentService

log = logging.getLogger(__name__)

SERVICE = "liveshard.v1.Agent"
_MAX_REQUEST_BYTES = 1 << 20  # the largest request is a Prepare of two layouts' member names


def _parse(kind: Any, raw: bytes) -> Any:
    """The request `raw` encodes; InvalidInput if it is none (protobuf's DecodeError is caught
    by its base: its module has no type stubs here)."""
    try:
        return kind.FromString(raw)
    except Exception as err:
        raise InvalidInput(f"request: not a valid {kind.DESCRIPTOR.full_name}: {err}") from None


def _fail(method: str, error: BaseException, context: grpc.ServicerContext) -> None:
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    else:
        log.info("%s refused: %s: %s", method, code.name, message)
    context.abort(code, message)


def _unary(method: str, kind: Any, call: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return call(_parse(kind, raw), context)
        except Exception as err:  # every error becomes a status, none a crash
            _fail(method, err, context)

    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)


def _stream(method: str, kind: Any, call: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    def handle(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from call(_parse(kind, raw), context)
        except Exception as err:  # every error becomes a status, none a crash
            _fail(method, err, context)

    return grpc.unary_stream_rpc_method_handler(handle, response_serializer=_serialize)


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def handlers(service: AgentService) -> grpc.GenericRpcHandler:
    methods = {
        "GetStatus": _unary("GetStatus", pb.GetStatusRequest, service.get_status),
        "WatchStatus": _stream("WatchStatus", pb.WatchStatusRequest, service.watch_status),
        "HostStore": _unary("HostStore", pb.HostStoreRequest, service.host_store_call),
        "Prepare": _unary("Prepare", pb.PrepareRequest, service.prepare),
        "Switch": _unary("Switch", pb.SwitchRequest, service.switch),
        "Abort": _unary("Abort", pb.AbortRequest, service.abort),
        "Checkpoint": _unary("Checkpoint", pb.CheckpointRequest, service.checkpoint),
        "Release": _unary("Release", pb.ReleaseRequest, service.release),
        "RotateCertificate": _unary(
            "RotateCertificate", pb.RotateCertificateRequest, service.rotate_certificate
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


_THREADS = WATCH_LIMIT + 16  # watchers hold a thread each; the rest serve the unary calls
MAX_CALLS = 2 * _THREADS  # calls in service or queued at once


def start_server(
    service: AgentService, token: str, address: str, tls: ServingCertificate | None = None
) -> grpc.Server:
    """Serve on `address` (the pod IP and port); RuntimeError if it cannot be bound.

    With `tls`, over mutual TLS: a caller that presents no client certificate signed by the
    job's CA is refused at the handshake, before the token is even read; a rotated serving
    certificate is taken by the next handshake. Without it, in plaintext, guarded by the token
    alone."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="agent-rpc"),
        handlers=[handlers(service)],
        interceptors=[TokenAuth(token)],
        # Calls beyond the threads wait in a bounded queue; more are refused RESOURCE_EXHAUSTED.
        maximum_concurrent_rpcs=MAX_CALLS,
        options=[
            ("grpc.so_reuseport", 0),  # a port another process holds is an error, not shared
            ("grpc.max_receive_message_length", _MAX_REQUEST_BYTES),
        ],
    )
    if tls is None:
        log.warning("serving the agent API on %s in plaintext: no LIVESHARD_TLS_* set", address)
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, tls.credentials())
    server.start()
    return server
