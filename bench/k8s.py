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
- goodput through volatile capacity: one scripted sequence of changes (scale 4 -> 2, a worker
  lost, scale 2 -> 3, 40 s of training before each and after the last), live and then by
  checkpoint and restart at each change: the share of the wall time the job trained (`goodput`).

- pods of 2 members each (`membersPerPod: 2`, tp=2 inside pods): 2 -> 3 pods live, then a
  member's process killed (its pod ends with it, both members recovered in memory at once).

    python bench/k8s.py [--out bench/results/k8s.json] [--only goodput|pods]
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from common import machine, write_json
from liveshard_operator import pki
from liveshard_operator.agents import AgentClient, ClientTls

from liveshard.v1 import agent_pb2 as pb
from liveshard_e2e import cluster
from liveshard_e2e.testing import Kube, member_pid
from liveshard_e2e.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "liveshard-bench"
JOB = "tiny"
STARTUP = 300.0


def _status(kube: Kube) -> dict[str, Any]:
    path = f"/apis/liveshard.io/v1alpha1/namespaces/{NAMESPACE}/elastictrainingjobs/{JOB}"
    return dict((kube.get(path) or {}).get("status") or {})


def _secret(kube: Kube, name: str) -> dict[str, bytes]:
    secret = kube.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}")
    assert secret is not None
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


def _token(kube: Kube) -> str:
    return _secret(kube, f"{JOB}-token")["token"].decode()


def _pod(kube: Kube, member: str) -> dict[str, Any]:
    """The pod of `member` (the member's own, or `<pod>` of a member `<pod>-<k>`)."""
    pod = kube.pod(member) or kube.pod(member.rsplit("-", 1)[0])
    assert pod is not None, member
    return pod


def _agent(kube: Kube, member: str) -> AgentClient:
    """One member's agent, called directly as the operator calls it: over mutual TLS with the
    operator's client certificate, and with the token."""
    pod = _pod(kube, member)
    operator = _secret(kube, f"{JOB}-operator-tls")
    tls = ClientTls(ca=operator["ca.crt"], cert=operator["tls.crt"], key=operator["tls.key"],
                    server_name=pki.server_name(JOB, NAMESPACE))  # fmt: skip
    return AgentClient(member, pod["status"]["podIP"], 7070, _token(kube), tls=tls)


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


def _new_epoch(stayer: AgentClient, epoch: int) -> int:
    """The epoch after `epoch` once `stayer` trains in it."""

    def in_new_epoch() -> int | None:
        s = stayer.status()
        moved = s.epoch > epoch and s.phase == pb.AgentStatus.TRAINING
        return int(s.epoch) if moved else None

    return wait_until(in_new_epoch, STARTUP, "a member training in the new epoch")


def live(kube: Kube, replicas: int) -> dict[str, Any]:
    before = _training(kube, _status(kube)["replicas"])
    stayer = _agent(kube, before["members"][0])
    start = time.perf_counter()
    kube.kubectl("scale", f"etj/{JOB}", f"--replicas={replicas}")
    new_epoch = _new_epoch(stayer, before["epoch"])
    seconds = time.perf_counter() - start
    after = _training(kube, replicas, before["epoch"])
    last = after["lastReconfiguration"]
    assert last["result"] == "committed" and last["epoch"] == new_epoch, last
    return {
        "resize": f"{before['replicas']} -> {replicas}",
        "from": last["from"],
        "to": last["to"],
        "scale_to_first_step_seconds": round(seconds, 3),
        "pause_seconds": last["pauseSeconds"],
        "bytes_moved": last["bytesMoved"],
    }


def _recovery(
    kube: Kube, survivor: AgentClient, epoch: int, kill: Callable[[], object]
) -> tuple[float, int, dict[str, Any]]:
    """`kill()` a member of the world in `epoch`: the seconds until `survivor` trains in the
    recovery's epoch, that epoch, and the recovery as the job records it."""
    start = time.perf_counter()
    kill()
    new_epoch = _new_epoch(survivor, epoch)
    seconds = time.perf_counter() - start
    last = wait_until(
        lambda: (r := _status(kube).get("lastReconfiguration") or {}).get("epoch") == new_epoch
        and r, STARTUP, "the recovery recorded",
    )  # fmt: skip
    return seconds, new_epoch, last


def lost(kube: Kube) -> dict[str, Any]:
    """Force-delete the last member's pod; the job recovers without it, then grows back."""
    before = _training(kube, len(_status(kube)["members"]))
    victim = before["members"][-1]
    survivor = _agent(kube, before["members"][0])
    seconds, new_epoch, last = _recovery(
        kube, survivor, before["epoch"],
        lambda: kube.kubectl("delete", "pod", victim, "--grace-period=0", "--force"),
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
    agents = [_agent(kube, m) for m in running["members"]]
    at_step = running["step"] + 2
    path = os.path.join(directory, f"ckpt-{number}")
    for agent in agents:
        agent.checkpoint(number, path, at_step)
    saved: Any = wait_until(  # the agents' last checkpoint, once all saved it
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
        stayer = _agent(kube, first["members"][0])
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
        # The API's stamps are whole seconds, so the node's opening is too: to within 1 s.
        "of_which_scheduling_seconds": scheduled - math.floor(opened),
        "pause_seconds": last["pauseSeconds"],
        "bytes_moved": last["bytesMoved"],
    }


def pods(kube: Kube) -> dict[str, Any]:
    """A job in pods of 2 members each (`membersPerPod: 2`, tp=2 inside each pod, no ZeRO): 2
    pods scaled to 3, then one member's process killed, which ends its pod: the time from each
    to a member that stays training in the new epoch, and its pause."""
    kube.kubectl("delete", "etj", JOB, "--wait=true", "--ignore-not-found", timeout=180)
    body = _job(2)
    body["spec"].update(membersPerPod=2, parallelism={"tp": 2, "zero": 0})
    kube.apply(body)
    first = _training(kube, 2)
    time.sleep(5)
    grown = live(kube, 3)
    before = _training(kube, 3)
    victim = before["members"][-1]
    survivor = _agent(kube, before["members"][0])
    pid = member_pid(_pod(kube, victim), victim)
    seconds, _, last = _recovery(kube, survivor, before["epoch"], lambda: os.kill(pid, 9))
    assert last["result"] == "committed" and last["reason"].startswith("lost "), last
    return {
        "first": first["layout"], "members": len(first["members"]), "grow": grown,
        "lost": {
            "lost": last["reason"], "from": last["from"], "to": last["to"],
            "kill_to_first_step_seconds": round(seconds, 3),
            "pause_seconds": last["pauseSeconds"], "bytes_moved": last["bytesMoved"],
        },
    }  # fmt: skip


SPAN = 40.0  # seconds of training before each capacity change, and after the last


def _history_since(kube: Kube, since: float) -> list[dict[str, Any]]:
    """The job's reconfigurations that ended after `since` (seconds since the epoch)."""
    history = _status(kube).get("history") or []
    return [h for h in history if datetime.fromisoformat(h["time"]).timestamp() >= since]


def goodput(kube: Kube, scratch: str) -> dict[str, Any]:
    """One scripted sequence of capacity changes, SPAN seconds of training before each and after
    the last: scale 4 -> 2, a worker lost (the job grows back to 2 when its pod is replaced),
    scale 2 -> 3. Done live, then by checkpoint and restart at each change. Goodput is the share
    of the wall time the job trained: live, the wall time less the exposed pauses of every
    reconfiguration (from the job's status.history); restarting, less each checkpoint's save and
    each delete-recreate-resume, the loss counted as if a checkpoint had been saved just before
    it (the best case for restarting)."""
    kube.kubectl("delete", "etj", JOB, "--wait=true", "--ignore-not-found", timeout=180)
    kube.apply(_job(4))
    _training(kube, 4)
    time.sleep(5)

    def arm(changes: list[Callable[[], float]]) -> dict[str, Any]:
        since, start = time.time(), time.perf_counter()
        first = _status(kube)["step"]
        down = 0.0
        for change in changes:
            time.sleep(SPAN)
            down += change()
        time.sleep(SPAN)
        wall = time.perf_counter() - start
        return {
            "wall_seconds": round(wall, 1), "down_seconds": round(down, 3),
            "goodput": round(1 - down / wall, 4), "steps": _status(kube)["step"] - first,
            "since": since,
        }  # fmt: skip

    def live_change(change: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            change()
            return 0.0  # the pauses are read from the job's history once the arm is done

        return run

    live_arm = arm([
        live_change(lambda: live(kube, 2)), live_change(lambda: lost(kube)),
        live_change(lambda: live(kube, 3)),
    ])  # fmt: skip
    paused = sum(h.get("pauseSeconds", 0.0) for h in _history_since(kube, live_arm.pop("since")))
    live_arm["down_seconds"] = round(paused, 3)
    live_arm["goodput"] = round(1 - paused / live_arm["wall_seconds"], 4)
    numbers = iter(range(11, 100))
    restart_arm = arm([
        lambda: restart(kube, 2, scratch, next(numbers))["total_seconds"],
        lambda: restart(kube, 2, scratch, next(numbers))["total_seconds"],
        lambda: restart(kube, 3, scratch, next(numbers))["total_seconds"],
    ])  # fmt: skip
    restart_arm.pop("since")
    return {
        "sequence": "scale 4 -> 2, lose 1 of 2 (grow back), scale 2 -> 3",
        "span_seconds": SPAN, "live": live_arm, "checkpoint_restart": restart_arm,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    parser.add_argument("--only", choices=["goodput", "pods"], help="run this scenario alone")
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
        if args.only is not None:
            scenario = goodput(kube, scratch) if args.only == "goodput" else pods(kube)
            result: dict[str, Any] = {
                "machine": machine("local cluster (process kubelet), gloo on CPU"),
                args.only: scenario,
            }  # fmt: skip
            print(json.dumps(result, indent=1), flush=True)
            write_json(args.out, result)
            return
        kube.apply(_job(4))
        _training(kube, 4)
        time.sleep(5)
        resizes = [live(kube, 2), live(kube, 3)]
        recovery = lost(kube)
        restarts = [restart(kube, 2, scratch, 1), restart(kube, 3, scratch, 2)]
        arrival = landing(kube, list(info.nodes))
        volatile = goodput(kube, scratch)
        in_pods = pods(kube)
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
            "landing": arrival, "goodput": volatile, "pods": in_pods,
        }  # fmt: skip
        print(json.dumps(result, indent=1), flush=True)
        write_json(args.out, result)
    finally:
        if not args.keep:
            cluster.down("bench")


if __name__ == "__main__":
    main()
