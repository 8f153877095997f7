"""A job's NetworkPolicy enforced, on a local cluster whose pods have network namespaces of
their own and whose policies the kernel applies (``pod_network="netns"``, docs/cluster.md): the
job's workers reach each other (and train under a read-only root filesystem), the operator
reaches their agents, and any other pod is kept from the agents' port while it still reaches
what the policy leaves open, unless a policy on its own egress keeps it from that."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until
from tests.e2e.test_operator import JOB, installed, members, pod_port, started, training

# Tries each HOST:PORT argument every half second and prints "HOST:PORT open|closed".
PROBE = """
import socket, sys, time
while True:
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            print(target, "open", flush=True)
        except OSError:
            print(target, "closed", flush=True)
    time.sleep(0.5)
"""


def prober(kube: Kube, targets: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "outsider", "namespace": kube.namespace,
                     "labels": {"role": "outsider"}},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "probe", "image": "python", "command": ["python", "-c", PROBE, *targets],
        }]},
    }  # fmt: skip


def reached(kube: Kube, target: str, state: str) -> bool:
    """The outsider's last two attempts at ``target`` both found it ``state``."""
    seen = [line.split()[1] for line in kube.logs("outsider").splitlines()
            if line.startswith(f"{target} ")]  # fmt: skip
    return seen[-2:] == [state, state]


def test_a_jobs_policy_keeps_other_pods_from_its_agents_and_lets_its_workers_and_operator_in(
    netns_kube: Kube, tmp_path: Path
) -> None:
    kube = netns_kube
    with installed(kube, tmp_path):
        # Two workers in two namespaces of their own train together: they reach each other.
        steps, first = started(kube, 2)
        pods = list(members(kube).values())
        ips = {p["status"]["podIP"] for p in pods}
        assert len(ips) == 2 and not any(ip.startswith("127.") for ip in ips)
        # They train with the chart's read-only root filesystem, /tmp (a volume's) writable.
        for p in pods:
            agent_container = p["spec"]["containers"][0]
            assert agent_container["securityContext"]["readOnlyRootFilesystem"] is True
            assert {"/tmp"} == {m["mountPath"] for m in agent_container["volumeMounts"]}
        pod = pods[0]
        agent = f"{pod['status']['podIP']}:{pod_port(pod, 'agent')}"
        scrape = f"{pod['status']['podIP']}:{pod_port(pod, 'metrics')}"
        kube.apply(prober(kube, [agent, scrape]))

        def log() -> str:
            return kube.logs("outsider")[-600:]

        # Another pod is kept from the agent's port, and reaches the metrics port, which the
        # policy leaves open to anyone.
        wait_until(lambda: reached(kube, agent, "closed") and reached(kube, scrape, "open"),
                   90, "the outsider kept from the agent only", describe=log)  # fmt: skip
        # A policy of the user's that admits it (policies add up) opens the agent's port to it,
        # and removing it closes the port again: the refusal is the job's policy.
        extra = {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "admit-outsider", "namespace": kube.namespace},
            "spec": {"podSelector": {"matchLabels": {"liveshard.io/job": JOB}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "outsider"}}}],
                                  "ports": [{"port": pod_port(pod, "agent")}]}]},
        }  # fmt: skip
        kube.apply(extra)
        wait_until(lambda: reached(kube, agent, "open"), 30, "the agent opened", describe=log)
        kube.kubectl("delete", "networkpolicy", "admit-outsider")
        wait_until(lambda: reached(kube, agent, "closed"), 30, "the agent closed", describe=log)
        # A policy of the user's on the outsider's egress, to the workers' agent port only, keeps
        # it from the metrics port the job's policy leaves open: both ends' policies apply.
        egress = {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "outsider-egress", "namespace": kube.namespace},
            "spec": {"podSelector": {"matchLabels": {"role": "outsider"}},
                     "policyTypes": ["Egress"],
                     "egress": [{"ports": [{"port": pod_port(pod, "agent")}]}]},
        }  # fmt: skip
        kube.apply(egress)
        wait_until(lambda: reached(kube, scrape, "closed"), 30, "metrics closed", describe=log)
        assert reached(kube, agent, "closed")
        kube.kubectl("delete", "networkpolicy", "outsider-egress")
        wait_until(lambda: reached(kube, scrape, "open"), 30, "metrics reopened", describe=log)

        # The operator still reaches the agents: it shrinks the job live, and it trains on.
        kube.kubectl("patch", "etj", JOB, "--type", "merge", "-p",
                     json.dumps({"spec": {"replicas": 1}}))  # fmt: skip
        shrunk = steps.wait(training(1, first["epoch"] + 1), "training with 1 after the shrink")
        steps.wait(lambda s: s.get("step", 0) > shrunk["step"] + 2, "training on")
