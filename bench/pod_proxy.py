"""What the hop through a pod's supervisor costs an operator's call to one of its members.

A pod of several members serves one endpoint: its supervisor's proxy (`server.pod.Proxy`) takes
each call over mutual TLS, checks the token and forwards the request's bytes to the member it
names, over the member's Unix socket, where the member checks the token again. This measures
`GetStatus`, the call the operator makes on every member each pass, from the operator's client
(`AgentClient`, mutual TLS, the job's CA) to a member's API served:
- `direct`: on TCP with mutual TLS, as a pod's lone agent serves it;
- `proxied`: behind the proxy, as a member of a pod of several is reached.
And the operator's look at a whole pod of 8 members in a pass: each member's `GetStatus`
through the proxy, all at once (`per_member`), against the pod's one `GetPodStatus`
(`pod_call`), which the proxy answers by asking its members at once.

The member is a stand-in that answers a full status message at once (what a real agent's
`GetStatus` does: it reads its status board), so the figures are the transport's and the hop's.
Sequential calls (latency: median and 99th percentile) and calls from 16 threads at once (the
operator's fan-out: calls a second).

    python bench/pod_proxy.py --out bench/results/pod-proxy.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from common import machine, write_json
from liveshard_operator import pki
from liveshard_operator.agents import AgentClient, ClientTls, fan_out

from liveshard.v1 import agent_pb2 as pb
from liveshard_agent.server import listen
from liveshard_agent.server.certs import ServingCertificate
from liveshard_agent.server.config import Tls
from liveshard_agent.server.pod import PodMember, Proxy
from liveshard_e2e.procs import free_port

TOKEN = "bench-token"
POD = "w"
MEMBERS = [f"{POD}-{k}" for k in range(8)]  # a pod of 8 GPUs
MEMBER = MEMBERS[0]
THREADS = 16  # the operator's status fan-out


def _status(member: str) -> bytes:
    """A member's status as an agent in a world sends it: its scalars set and its last
    checkpoint."""
    status = pb.AgentStatus(
        member=member, phase=pb.AgentStatus.TRAINING, ready=True, epoch=7, step=12345,
        loss=2.345, steps=100000, samples=12345 * 24, state_bytes=3 << 30,
    )  # fmt: skip
    status.last_checkpoint.CopyFrom(
        pb.CheckpointSummary(number=12, step=12000, path="/ckpt/job/step-12000")
    )
    return bytes(status.SerializeToString())


class Member(grpc.GenericRpcHandler):
    """A member's API reduced to `GetStatus`, answered at once."""

    def __init__(self, name: str) -> None:
        self.answer = _status(name)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if details.method.endswith("/GetStatus"):
            return grpc.unary_unary_rpc_method_handler(lambda raw, context: self.answer)
        return None


def _time(call: Callable[[], object], count: int) -> list[float]:
    """Seconds of each of `count` calls, one after another (after 50 not counted)."""
    for _ in range(50):
        call()
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def _rate(clients: list[AgentClient], calls: int) -> float:
    """Calls a second, `calls` spread over the clients by the operator's fan-out."""
    start = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda k: clients[k % len(clients)].status(), range(calls)))
    return calls / (time.perf_counter() - start)


def measure(port: int, tls: ClientTls, count: int) -> dict[str, Any]:
    """Latency and throughput of `GetStatus` at `127.0.0.1:port`."""
    clients = [AgentClient(MEMBER, "127.0.0.1", port, TOKEN, tls=tls) for _ in range(THREADS)]
    try:
        first = fan_out(lambda c: c.status(), clients)[0]  # every channel connected
        seconds = sorted(_time(clients[0].status, count))
        return {
            "step": first.step,  # the member's answer came back whole
            "serving_certificate": first.serving_certificate,  # stamped by a proxy
            "median_ms": round(statistics.median(seconds) * 1e3, 3),
            "p99_ms": round(seconds[int(0.99 * (len(seconds) - 1))] * 1e3, 3),
            "calls_per_second_16_threads": round(_rate(clients, count), 1),
        }
    finally:
        for client in clients:
            client.close()


def measure_pod(port: int, tls: ClientTls, count: int) -> dict[str, Any]:
    """A pass's look at the whole pod at `127.0.0.1:port`: its members' calls at once, or its
    one call; milliseconds per pass."""
    clients = [AgentClient(m, "127.0.0.1", port, TOKEN, tls=tls) for m in MEMBERS]
    try:
        whole = clients[0].pod_status()
        assert sorted(s.member for s in whole.members) == MEMBERS, whole
        passes = max(50, count // len(MEMBERS))
        ways = {
            "per_member": lambda: fan_out(lambda c: c.status(), clients),
            "pod_call": clients[0].pod_status,
        }
        out: dict[str, Any] = {"members": len(MEMBERS)}
        for way, look in ways.items():
            seconds = sorted(_time(look, passes))
            out[f"{way}_median_ms"] = round(statistics.median(seconds) * 1e3, 3)
            out[f"{way}_p99_ms"] = round(seconds[int(0.99 * (len(seconds) - 1))] * 1e3, 3)
        return out
    finally:
        for client in clients:
            client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per measurement")
    parser.add_argument("--quick", action="store_true", help="100 calls (a smoke run)")
    parser.add_argument("--out", default="bench/results/pod-proxy.json")
    args = parser.parse_args(argv)
    calls = 100 if args.quick else args.calls

    ca = pki.new_authority()
    served, client = pki.serving_pair(ca, "bench", "ns"), pki.operator_pair(ca)
    tls = ClientTls(ca.cert, client.cert, client.key, pki.server_name("bench", "ns"))

    def serving() -> ServingCertificate:
        return ServingCertificate(Tls(served.cert, served.key, ca.cert))

    folder = Path(tempfile.mkdtemp(prefix="liveshard-pod-"))
    members = [PodMember(m, f"unix:{folder / f'{m}.sock'}", 0) for m in MEMBERS]
    direct_port, proxy_port = free_port(), free_port()
    servers = [listen.serve(Member(m.name), TOKEN, m.address, None, 32, m.name) for m in members]
    servers.append(
        listen.serve(Member(MEMBER), TOKEN, f"127.0.0.1:{direct_port}", serving(), 32, "direct")
    )
    proxy = Proxy(members, serving())
    servers.append(listen.serve(proxy, TOKEN, f"127.0.0.1:{proxy_port}", serving(), 32, "pod"))
    try:
        direct = measure(direct_port, tls, calls)
        proxied = measure(proxy_port, tls, calls)
        pod = measure_pod(proxy_port, tls, calls)
    finally:
        proxy.close()
        for server in servers:
            server.stop(None)
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "machine": machine(f"grpcio {grpc.__version__}"),
        "calls": calls,
        "direct": direct,
        "proxied": proxied,
        "hop_median_ms": round(proxied["median_ms"] - direct["median_ms"], 3),
        "pod": pod,
    }
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
