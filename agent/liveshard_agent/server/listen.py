"""The gRPC server of an agent or of a pod of several members: bound to one address, behind
mutual TLS (when configured) and the token check, with bounded threads and calls. No torch: a
pod's supervisor serves with it too.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from .auth import TokenAuth
from .certs import ServingCertificate

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20  # the largest request is a Prepare of two layouts' member names


def serve(
    handler: grpc.GenericRpcHandler,
    token: str,
    address: str,
    tls: ServingCertificate | None,
    threads: int,
    name: str,
) -> grpc.Server:
    """Serve `handler` on `address` with `threads` threads (`name` their prefix); RuntimeError
    if it cannot be bound.

    With `tls`, over mutual TLS: a caller that presents no client certificate signed by the
    job's CA is refused at the handshake, before the token is even read; a rotated serving
    certificate is taken by the next handshake. Without it, in plaintext, guarded by the token
    alone. Calls beyond the threads wait in a bounded queue; more are refused
    RESOURCE_EXHAUSTED."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name),
        handlers=[handler],
        interceptors=[TokenAuth(token)],
        maximum_concurrent_rpcs=2 * threads,
        options=[
            ("grpc.so_reuseport", 0),  # a port another process holds is an error, not shared
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ],
    )
    if tls is None:
        log.warning("serving the agent API on %s in plaintext: no LIVESHARD_TLS_* set", address)
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, tls.credentials())
    server.start()
    return server
