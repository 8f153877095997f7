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
from typing import Any

import grpc

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput

from . import listen
from .certs import ServingCertificate
from .errors import status_of
from .service import WATCH_LIMIT, AgentService

log = logging.getLogger(__name__)

SERVICE = "liveshard.v1.Agent"


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
        "GetPodStatus": _unary("GetPodStatus", pb.GetStatusRequest, service.get_pod_status),
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


def start_server(
    service: AgentService, token: str, address: str, tls: ServingCertificate | None = None
) -> grpc.Server:
    """Serve `service` on `address` (the pod IP and port, or a member's socket); RuntimeError if
    it cannot be bound (`listen.serve`)."""
    return listen.serve(handlers(service), token, address, tls, _THREADS, "agent-rpc")
