"""How long members take to connect to an epoch's c10d store when they all connect at once, and
why. torch's connect looks up the host name of an address on each side (`getnameinfo` without
`NI_NUMERICHOST`): the client of the store's address, the store of each client's, one after
another on its event loop. IPv4 addresses reach them as IPv4-mapped IPv6 addresses, which
`/etc/hosts` does not answer, so each lookup asks the DNS server. A cluster's DNS answers at once;
a resolver that drops part of a burst makes each dropped lookup wait its timeout (glibc: 5 s, then
again). This measures both at one instant, for several counts of members: N clients connecting,
and N reverse lookups of the address the store sees (127.0.0.1, mapped).

    python bench/store.py --out bench/results/store.json
    python bench/store.py --resolver-timeout 1      # the resolver's timeout, through RES_OPTIONS
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import machine, write_json

MAPPED_LOOPBACK = "::ffff:127.0.0.1"


def at_once(count: int, fn: Callable[[], Any]) -> dict[str, float]:
    """The median and the longest of `count` calls of `fn`, each in a thread, let go together."""
    gate, seconds, kept = threading.Barrier(count), [], []

    def one() -> None:
        gate.wait()
        start = time.perf_counter()
        kept.append(fn())  # kept to the end: connections stay open, as members' do
        seconds.append(time.perf_counter() - start)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"median": statistics.median(seconds), "max": max(seconds)}


def measure(count: int) -> dict[str, Any]:
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=60)
    server = TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    connect = at_once(count, lambda: TCPStore("127.0.0.1", server.port, None, False, timeout))
    address, failed = (MAPPED_LOOPBACK, server.port, 0, 0), []

    def lookup() -> None:
        try:
            socket.getnameinfo(address, socket.NI_NUMERICSERV)
        except socket.gaierror:  # torch then formats the address as digits, after the wait
            failed.append(1)

    looked_up = at_once(count, lookup)
    return {"members": count, "connect_seconds": connect, "reverse_lookup_seconds": looked_up,
            "reverse_lookups_failed": len(failed)}  # fmt: skip


def resolver() -> dict[str, Any]:
    """What decides a lookup's wait: the servers and options of resolv.conf, and RES_OPTIONS."""
    conf = Path("/etc/resolv.conf")
    lines = conf.read_text().splitlines() if conf.exists() else []
    keep = [line.strip() for line in lines if line.split()[:1] in (["nameserver"], ["options"])]
    return {"resolv_conf": keep, "RES_OPTIONS": os.environ.get("RES_OPTIONS", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--resolver-timeout", type=int, default=None,
                        help="seconds a lookup waits for the DNS server (RES_OPTIONS)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="8 and 32 members")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.resolver_timeout is not None:  # read by glibc when this process first resolves
        os.environ["RES_OPTIONS"] = f"timeout:{args.resolver_timeout} attempts:1"
    import torch

    counts = [8, 32] if args.quick else args.members
    rows = [measure(count) for count in counts]
    for row in rows:
        print(f"{row['members']:>5} members: connect max {row['connect_seconds']['max']:.2f} s, "
              f"reverse lookup max {row['reverse_lookup_seconds']['max']:.2f} s "
              f"({row['reverse_lookups_failed']} failed)")  # fmt: skip
    report = {"machine": machine(f"torch {torch.__version__}"), "resolver": resolver(),
              "rows": rows}  # fmt: skip
    write_json(args.out, report)


if __name__ == "__main__":
    main()
