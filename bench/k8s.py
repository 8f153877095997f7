"""Resizing a job on the local Kubernetes cluster: live, against the way users resize today.

On the local cluster (3 nodes, the chart's operator, the example `tiny` job on CPU without ZeRO),
in one run:

- live: `kubectl scale` 4 -> 2, then 2 -> 3. For each: the time from the scale command to the
  moment a member that stays reports training in the new epoch (the first step in the new layout
  starts; for 2 -> 3 this includes the new pod's start and pre-warm), and the exposed pause inside
  it (the job's `lastReconfiguration.pauseSeconds`: the last step before to the first step after).
- a worker lost without notice (its pod force-deleted: the process killed at once, its memory
  gone): the time from the deletion to a survivor training in the recovery's epoch, and the
  exposed pause (the survivors' break to their first step after); compared with what users do
  today, a restart of the survivors from the last checkpoint (the delete, recreate and resume
  time measured below, plus the steps since that checkpoint, lost).
- the way users resize today, to the same sizes, from the same job: a DCP checkpoint of the
  running job (the agents' own checkpoint, its save time measured), then every pod force-deleted
  and the job recreated with the new replica count resuming from that checkpoint
  (`spec.checkpoint.restoreFrom`), timed from the deletion to the moment a member reports
  training past the checkpoint's step: process start, `import torch`, the world's groups and the
  load included.
- capacity as it lands: a job of 4 (minReplicas 2) whose workers fit only 2 to a node, with one
  node open: the time from the apply to training with 2; then a second node opens (uncordon): the
  time from that to a member training in the grown layout, both new pods joining in one
  reconfiguration (the scheduling, the processes' start and pre-warm included), and its pause.

    python bench/k8s.py [--out bench/results/k8s.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import yaml
from common import machine, write_json

from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_e2e import cluster
from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "liveshard-bench"
JOB = "tiny"
STARTUP = 300.0


def _status(kube: Kube) -> dict[str, Any]:
    path = f"/apis/liveshard.io/v1alpha1/namespaces/{NAMESPACE}/elastictrainingjobs/{JOB}"
    return dict((kube.get(path) or {}).get("status") or {})


def _token(kube: Kube) -> str:
    secret = kube.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{JOB}-token")
    assert secret is not None
    return base64.b64decode(secret["data"]["token"]).decode()


class Agent:
    """One member's agent, called directly (as the operator does)."""

    def __init__(self, kube: Kube, member: str) -> None:
        pod = kube.pod(member)
        assert pod is not None
        self.channel = grpc.insecure_channel(f"{pod['status']['podIP']}:7070")
        self.stub = pb_grpc.AgentStub(self.channel)
        self.metadata = (("authorization", f"Bearer {_token(kube)}"),)

    def status(self) -> pb.AgentStatus:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=self.metadata)

    def checkpoint(self, number: int, path: str, at_step: int) -> None:
        request = pb.CheckpointRequest(number=number, path=path, at_step=at_step)
        self.stub.Checkpoint(request, timeout=10, metadata=self.metadata)


def _job(replicas: int, restore: str = "") -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "tiny-job.yaml").read_text())
    body["spec"]["replicas"] = replicas
    # Without ZeRO every replica holds the whole state: a lost worker is rebuilt from memory.
    body["spec"]["parallelism"]["zero"] = 0
    if restore:
        body["spec"]["checkpoint"] = {"restoreFrom": restore}
    return dict(body)


def _training(kube: Kube, replicas: int, after_epoch: int = -1) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        s = _status(kube)
        ok = s.get("phase") == "Running" and s.get("readyReplicas") == replicas
        return s if ok and s.get("epoch", -1) > after_epoch else None

    return wait_until(check, STARTUP, f"{JOB} training with {replicas} members")


def _new_epoch(stayer: Agent, epoch: int) -> int:
    """The epoch after `epoch` once `stayer` trains in it."""

    def in_new_epoch() -> int | None:
        s = stayer.status()
        moved = s.epoch > epoch and s.phase == pb.AgentStatus.TRAINING
        return int(s.epoch) if moved else None

    return wait_until(in_new_epoch, STARTUP, "a member training in the new epoch")


def live(kube: Kube, replicas: int) -> dict[str, Any]:
    before = _training(kube, len(_status(kube)["members"]))
    stayer = Agent(kube, before["members"][0])
    start = time.perf_counter()
    kube.kubectl("scale", f"etj/{JOB}", f"--replicas={replicas}")
    new_epoch = _new_epoch(stayer, before["epoch"])
    seconds = time.perf_counter() - start
    after = _training(kube, replicas, before["epoch"])
    last = after["lastReconfiguration"]
    assert last["result"] == "committed" and last["epoch"] == new_epoch, last
    return {
        "resize": f"{len(before['members'])} -> {replicas}",
        "from": last["from"],
        "to": last["to"],
        "scale_to_first_step_seconds": round(seconds, 3),
        "pause_seconds": last["pauseSeconds"],
        "bytes_moved": last["bytesMoved"],
    }


def lost(kube: Kube) -> dict[str, Any]:
    """Force-delete the last member's pod; the job recovers without it, then grows back."""
    before = _training(kube, len(_status(kube)["members"]))
    victim = before["members"][-1]
    survivor = Agent(kube, before["members"][0])
    start = time.perf_counter()
    kube.kubectl("delete", "pod", victim, "--grace-period=0", "--force")
    new_epoch = _new_epoch(survivor, before["epoch"])
    seconds = time.perf_counter() - start
    last = wait_until(
        lambda: (r := _status(kube).get("lastReconfiguration") or {}).get("epoch") == new_epoch
        and r, STARTUP, "the recovery recorded",
    )  # fmt: skip
    assert last["result"] == "committed" and f"lost {victim}" in last["reason"], last
    _training(kube, len(before["members"]), new_epoch)  # a new pod pre-warmed and joined
    return {
        "lost": f"1 of {len(before['members'])}",
        "from": last["from"],
        "to": last["to"],
        "delete_to_first_step_seconds": round(seconds, 3),
        "pause_seconds": last["pauseSeconds"],
        "bytes_moved": last["bytesMoved"],
    }


def restart(kube: Kube, replicas: int, directory: str, number: int) -> dict[str, Any]:
    """Checkpoint the running job, delete every pod, recreate it with `replicas` from there."""
    running = _training(kube, len(_status(kube)["members"]))
    agents = [Agent(kube, m) for m in running["members"]]
    at_step = running["step"] + 2
    path = os.path.join(directory, f"ckpt-{number}")
    for agent in agents:
        agent.checkpoint(number, path, at_step)
    saved = wait_until(
        lambda: all(a.status().last_checkpoint.number == number for a in agents)
        and agents[0].status().last_checkpoint, STARTUP, "the checkpoint saved",
    )  # fmt: skip
    start = time.perf_counter()
    kube.kubectl("delete", "etj", JOB, "--wait=false")
    kube.kubectl("delete", "pods", "-l", f"liveshard.io/job={JOB}", "--grace-period=0", "--force")
    path_of_job = f"/apis/liveshard.io/v1alpha1/namespaces/{NAMESPACE}/elastictrainingjobs/{JOB}"
    wait_until(lambda: kube.get(path_of_job) is None, 120, "the job deleted")
    kube.apply(_job(replicas, restore=path))
    resumed = wait_until(
        lambda: (s := _status(kube)).get("phase") == "Running"
        and s.get("step", 0) > saved.step and s, STARTUP, "the job resumed from the checkpoint",
    )  # fmt: skip
    seconds = time.perf_counter() - start
    return {
        "resize": f"{len(running['members'])} -> {replicas}",
        "checkpoint_save_seconds": round(saved.seconds, 3),
        "delete_recreate_resume_seconds": round(seconds, 3),
        "total_seconds": round(saved.seconds + seconds, 3),
        "resumed_at_step": resumed["step"],
    }


def _scheduled_at(pod: dict[str, Any]) -> float:
    """When the scheduler placed `pod` (seconds since the epoch, to the second)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    placed = next(c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "True")
    return datetime.fromisoformat(placed["lastTransitionTime"]).timestamp()


def landing(kube: Kube, nodes: list[str]) -> dict[str, Any]:
    """A job of 4 (at least 2) where only 2 workers fit: it starts with 2; then a node opens and
    both pods that land there join in one reconfiguration."""
    kube.kubectl("delete", "etj", JOB, "--wait=true", timeout=180)
    body = _job(4)
    body["spec"]["minReplicas"] = 2
    # 3.5 of a node's 8 CPUs each: 2 workers fit a node, and only one node is open.
    body["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3500m"
    kube.run("kubectl", "cordon", *nodes[1:])
    try:
        start = time.perf_counter()
        kube.apply(body)
        first = _training(kube, 2)
        started = time.perf_counter() - start
        stayer = Agent(kube, first["members"][0])
        time.sleep(5)
        start, opened = time.perf_counter(), time.time()
        kube.run("kubectl", "uncordon", nodes[1])
        new_epoch = _new_epoch(stayer, first["epoch"])
        seconds = time.perf_counter() - start
        grown = _training(kube, 4, first["epoch"])
    finally:
        kube.run("kubectl", "uncordon", *nodes[1:], check=False)
    last = grown["lastReconfiguration"]
    assert last["result"] == "committed" and last["epoch"] == new_epoch, last
    joined = [kube.pod(m) or {} for m in grown["members"] if m not in first["members"]]
    scheduled = max(_scheduled_at(pod) for pod in joined)
    return {
        "start_with_2_of_4_seconds": round(started, 3),
        "grow": last["reason"],
        "from": last["from"],
        "to": last["to"],
        "uncordon_to_first_step_seconds": round(seconds, 3),
        "of_which_scheduling_seconds": round(scheduled - opened, 1),  # stamps are whole seconds
        "pause_seconds": last["pauseSeconds"],
        "bytes_moved": last["bytesMoved"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    args = parser.parse_args()
    info = cluster.up(cluster.ClusterOptions(name="bench", nodes=3))
    admin = Kube(info)
    scratch = tempfile.mkdtemp(
        prefix="liveshard-k8s-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    try:
        admin.run(
            "kubectl", "delete", "namespace", NAMESPACE, "--wait=true", check=False, timeout=180
        )
        kube = admin.create_namespace(NAMESPACE)
        kube.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        kube.run("helm", "upgrade", "--install", "liveshard", str(ROOT / "charts" / "liveshard"),
                 "-n", NAMESPACE, "--set", f"watchNamespaces={{{NAMESPACE}}}", "--wait",
                 "--timeout=180s", timeout=240)  # fmt: skip
        kube.apply(_job(4))
        _training(kube, 4)
        time.sleep(5)
        resizes = [live(kube, 2), live(kube, 3)]
        recovery = lost(kube)
        restarts = [restart(kube, 2, scratch, 1), restart(kube, 3, scratch, 2)]
        arrival = landing(kube, list(info.nodes))
        # Today a lost worker means restarting the survivors from the last checkpoint.
        recovery["checkpoint_restart_seconds"] = restarts[0]["delete_recreate_resume_seconds"]
        recovery["speedup_end_to_end"] = round(
            recovery["checkpoint_restart_seconds"] / recovery["delete_to_first_step_seconds"], 1
        )
        for live_one, restart_one in zip(resizes, restarts, strict=True):
            live_one["checkpoint_restart_seconds"] = restart_one["total_seconds"]
            live_one["speedup_end_to_end"] = round(
                restart_one["total_seconds"] / live_one["scale_to_first_step_seconds"], 1
            )
            live_one["speedup_pause"] = round(
                restart_one["total_seconds"] / live_one["pause_seconds"], 1
            )
        result = {
            "machine": machine("local cluster (process kubelet), gloo on CPU"),
            "live": resizes, "lost": recovery, "checkpoint_restart": restarts,
            "landing": arrival,
        }  # fmt: skip
        print(json.dumps(result, indent=1), flush=True)
        write_json(args.out, result)
    finally:
        if not args.keep:
            cluster.down("bench")


if __name__ == "__main__":
    main()
