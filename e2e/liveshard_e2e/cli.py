"""``liveshard-cluster``: start, inspect and stop the local cluster from a shell.

liveshard-cluster up [--nodes N] [--gpus-per-node G]   # prints the kubeconfig path first
liveshard-cluster status
liveshard-cluster env          # shell exports: eval "$(liveshard-cluster env)"
liveshard-cluster logs NAMESPACE/POD [CONTAINER]
liveshard-cluster heartbeat NODE on|off
liveshard-cluster down
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from liveshard_e2e import cluster
from liveshard_e2e.binaries import BinariesMissing
from liveshard_e2e.kubelet.config import set_heartbeat
from liveshard_e2e.kubelet.logserver import default_container, find_log


def _print_info(info: cluster.ClusterInfo) -> None:
    print(info.kubeconfig)
    print(f"kubectl {info.kubectl}")
    print(f"helm {info.helm}")
    print(f"server {info.server}")
    print(f"nodes {' '.join(info.nodes)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="liveshard-cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--name",
        default=os.environ.get("LIVESHARD_CLUSTER", "default"),
        help="cluster name (env LIVESHARD_CLUSTER; default %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the cluster (idempotent)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--gpus-per-node", type=int, default=0)
    up.add_argument("--node-cpu", default="8")
    up.add_argument("--node-memory", default="32Gi")
    up.add_argument(
        "--pod-network",
        choices=["loopback", "netns"],
        default="loopback",
        help="netns: a network namespace per pod, NetworkPolicies enforced (root needed)",
    )
    sub.add_parser("down", help="stop everything the cluster started")
    sub.add_parser("status", help="print the kubeconfig path if the cluster runs")
    sub.add_parser("env", help="print shell exports for KUBECONFIG and PATH")
    logs = sub.add_parser("logs", help="print a container's log")
    logs.add_argument("pod", help="NAMESPACE/POD")
    logs.add_argument("container", nargs="?")
    logs.add_argument("--previous", action="store_true")
    beat = sub.add_parser("heartbeat", help="stop or resume a node's heartbeats")
    beat.add_argument("node")
    beat.add_argument("state", choices=["on", "off"])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )

    try:
        if args.command == "up":
            t0 = time.monotonic()
            options = cluster.ClusterOptions(
                name=args.name,
                nodes=args.nodes,
                gpus_per_node=args.gpus_per_node,
                node_cpu=args.node_cpu,
                node_memory=args.node_memory,
                pod_network=args.pod_network,
            )
            info = cluster.up(options)
            _print_info(info)
            print(f"up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            return 0
        if args.command == "down":
            stopped = cluster.down(args.name)
            print(
                f"cluster {args.name}: {'stopped' if stopped else 'was not running'}",
                file=sys.stderr,
            )
            return 0
        if args.command in ("status", "env"):
            st = cluster.status(args.name)
            if st.info is None:
                detail = ", ".join(
                    f"{k} {'alive' if v else 'dead'}" for k, v in st.processes.items()
                )
                print(
                    f"cluster {args.name}: not running{': ' + detail if detail else ''}",
                    file=sys.stderr,
                )
                return 1
            if args.command == "status":
                _print_info(st.info)
            else:
                print(f"export KUBECONFIG={st.info.kubeconfig}")
                print(f'export PATH="{st.info.kubectl.parent}:$PATH"')
            return 0
        if args.command == "logs":
            namespace, _, pod = args.pod.rpartition("/")
            pods_dir = cluster.run_dir(args.name) / "kubelet" / "pods"
            container = args.container or default_container(pods_dir, namespace or "default", pod)
            if container is None:
                print(f"pod {args.pod}: name the container", file=sys.stderr)
                return 1
            path = find_log(pods_dir, namespace or "default", pod, container, args.previous)
            if path is None:
                print(f"no log for {args.pod} container {container}", file=sys.stderr)
                return 1
            sys.stdout.write(path.read_text(errors="replace"))
            return 0
        if args.command == "heartbeat":
            set_heartbeat(cluster.run_dir(args.name), args.node, args.state == "on")
            return 0
    except BinariesMissing as err:
        print(f"liveshard-cluster: {err}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as err:
        print(f"liveshard-cluster: {err}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
