"""Authentication: every call must carry the job's token as `authorization: Bearer <token>`.

A server interceptor checks the metadata before any handler runs (and before the request is even
parsed), comparing in constant time; a call without exactly one such header, or with a wrong
token, ends with UNAUTHENTICATED and reaches nothing. This module must not log the token.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

_HEADER = "authorization"
_SCHEME = "Bearer "


class TokenAuth(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = (_SCHEME + token).encode()

    def allows(self, metadata: Any) -> bool:
        values = [value for key, value in metadata or () if key.lower() == _HEADER]
        if len(values) != 1:
            return False
        given = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
        return hmac.compare_digest(given, self._expected)

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        if self.allows(details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED, token or not
        log.warning("refused a call to %s: no valid token", details.method)
        return _refusal(handler)


def _deny(_: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid job token is required")


def _refusal(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that refuses; no deserializer, so the request's
    bytes are never parsed."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)
