"""What an agent, or the supervisor of a pod of several members, serves: the gRPC API bound to
one address, behind mutual TLS (when configured) and the token check, with bounded threads and
calls; and a Prometheus registry at /metrics. No torch: a pod's supervisor serves with it too.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from .auth import TokenAuth
from .certs import ServingCertificate
from .config import AgentConfig

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


def serve_metrics(
    registry: CollectorRegistry,
    config: AgentConfig,
    logger: logging.LoggerAdapter[logging.Logger],
) -> WSGIServer | None:
    """`registry` served on LIVESHARD_METRICS_HOST (the pod IP unless set) at
    LIVESHARD_METRICS_PORT, or None when that is 0 or the port cannot be had: metrics are worth
    no stopped training (agents sharing one address, as the tests' do, find the default port
    taken), so that is logged, not fatal."""
    if config.metrics_port == 0:
        return None
    host = config.metrics_host or config.pod_ip
    try:
        server, _ = start_http_server(config.metrics_port, host, registry)
    except OSError as err:
        logger.warning("no metrics: cannot serve on port %s: %s", config.metrics_port, err)
        return None
    logger.info("serving metrics at %s:%s/metrics", host, config.metrics_port)
    return server
