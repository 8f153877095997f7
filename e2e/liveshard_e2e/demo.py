"""The README's main demo: liveshard on the local cluster, told as it happens.

It brings up the local cluster, installs the chart with helm (the operator), applies the example
`tiny` job (the built-in Qwen3-format model `qwen3-tiny` on BPE tokens), scales it 4 -> 2 -> 3
with `kubectl scale`, drains the node of one worker, kills a worker without notice, suspends it
and resumes it on 2 workers in another layout, then runs the same model in pods of 2 members
each (tp inside pods) and scales them 2 -> 3 pods, and prints
as it goes each reconfiguration's reason, layouts, pause and bytes, and the loss going on. At the
end it draws the job's story from its status with `liveshard timeline --job` (through kubectl,
as a user would) and prints where the picture is.

    python -m liveshard_e2e.demo [--keep] [--timeline FILE.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from liveshard_e2e import cluster
from liveshard_e2e.testing import Kube
from liveshard_e2e.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "liveshard-demo"
JOB = "tiny"
STARTUP = 300.0


class Narrator:
    """Prints the job's progress: its step and loss now and then, every new event at once."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.start = time.monotonic()
        self.stop = threading.Event()
        self.events: set[str] = set()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {text}", flush=True)

    def status(self) -> dict[str, Any]:
        path = f"/apis/liveshard.io/v1alpha1/namespaces/{NAMESPACE}/elastictrainingjobs/{JOB}"
        job = self.kube.get(path) or {}
        return dict(job.get("status") or {})

    def _watch(self) -> None:
        last_step = -10
        while not self.stop.wait(1.0):
            try:
                self._events()
                s = self.status()
            except Exception:  # the demo goes on; the next look may work
                continue
            if s.get("step", -1) >= last_step + 10:
                last_step = s["step"]
                self.say(f"step {s['step']:>5}  loss {s.get('loss', 0):.4f}  {s.get('phase')}  "
                         f"{len(s.get('members', []))} members: {s.get('layout')}")  # fmt: skip

    def _events(self) -> None:
        selector = f"involvedObject.name={JOB}"
        raw = self.kube.kubectl("get", "events", "-o", "json", "--field-selector", selector).stdout
        # In the order they were written: the timestamps have whole seconds; the local
        # cluster's etcd numbers its writes in order.
        for event in sorted(
            json.loads(raw)["items"],
            key=lambda e: (
                e["metadata"]["creationTimestamp"],
                int(e["metadata"]["resourceVersion"]),
            ),
        ):
            if event["metadata"]["uid"] in self.events or event["reason"] not in (
                "Reconfiguring",
                "Reconfigured",
                "ReconfigurationAborted",
                "Suspended",
            ):
                continue
            self.events.add(event["metadata"]["uid"])
            self.say(f"== {event['reason']}: {event['message']}")

    def wait(self, check: Callable[[dict[str, Any]], bool], what: str, timeout: float) -> None:
        wait_until(lambda: check(self.status()), timeout, what)


def _running(members: int, after: int = -1) -> Callable[[dict[str, Any]], bool]:
    def check(s: dict[str, Any]) -> bool:
        return (s.get("phase") == "Running" and s.get("readyReplicas") == members
                and s.get("epoch", -1) > after)  # fmt: skip

    return check


def draw_timeline(kube: Kube, out: Path) -> None:
    """The job's story as `liveshard timeline --job` draws it from the job's status."""
    command = [str(Path(sys.executable).parent / "liveshard"), "timeline", "--job", JOB, "-n",
               NAMESPACE, "--kubectl", str(kube.info.kubectl), "--out", str(out)]  # fmt: skip
    drawn = subprocess.run(command, capture_output=True, text=True, env=kube.env(), timeout=120,
                           check=False)  # fmt: skip
    if drawn.returncode != 0:
        print(f"== no timeline: {drawn.stderr.strip()}", flush=True)
        return
    print(f"== the job's timeline (liveshard timeline --job {JOB} -n {NAMESPACE}): {out}",
          flush=True)  # fmt: skip


def run(keep: bool, timeline: Path | None = None) -> None:
    print("== bringing up the local cluster (3 nodes)", flush=True)
    info = cluster.up(cluster.ClusterOptions(name="demo", nodes=3))
    admin = Kube(info)
    try:
        admin.run("kubectl", "delete", "namespace", NAMESPACE, "--wait=true", check=False,
                  timeout=180)  # fmt: skip
        kube = admin.create_namespace(NAMESPACE)
        print("== installing the CRD and the chart (the operator)", flush=True)
        kube.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f",
                 str(ROOT / "crds"))  # fmt: skip
        kube.run("helm", "upgrade", "--install", "liveshard", str(ROOT / "charts" / "liveshard"),
                 "-n", NAMESPACE, "--set", f"watchNamespaces={{{NAMESPACE}}}", "--wait",
                 "--timeout=180s", timeout=240)  # fmt: skip
        narrator = Narrator(kube)
        narrator.thread.start()
        narrator.say(
            "kubectl apply -f examples/tiny-job.yaml  (4 workers, ZeRO-1, each shard mirrored "
            "on the next worker: a dead worker's state is still in the others' memory)"
        )
        body = yaml.safe_load((ROOT / "examples" / "tiny-job.yaml").read_text())
        # Where a suspended job keeps its state (the workers are local processes here), and
        # periodic checkpoints.
        body["spec"]["checkpoint"] = {
            "path": str(cluster.run_dir("demo") / "checkpoints"),
            "everySteps": 50,
        }
        kube.apply(body)
        narrator.wait(_running(4), "the job training with 4 members", STARTUP)
        epoch = narrator.status()["epoch"]
        for replicas in (2, 3):
            time.sleep(10)
            narrator.say(f"kubectl scale etj/{JOB} --replicas={replicas}")
            kube.kubectl("scale", f"etj/{JOB}", f"--replicas={replicas}")
            narrator.wait(_running(replicas, epoch), f"the job on {replicas} members", STARTUP)
            epoch = narrator.status()["epoch"]
        time.sleep(10)
        members = narrator.status()["members"]
        pod = kube.pod(members[-1]) or {}
        node = pod["spec"]["nodeName"]
        narrator.say(f"kubectl drain {node}  (it runs worker {members[-1]})")
        drain = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s"]
        kube.run("kubectl", *drain, "--pod-selector", f"liveshard.io/job={JOB}", timeout=360)
        narrator.say(f"{node} drained; the job trains on")
        kube.run("kubectl", "uncordon", node)
        narrator.wait(_running(3, epoch), "the job back on 3 members", STARTUP)
        epoch = narrator.status()["epoch"]
        time.sleep(10)
        victim = narrator.status()["members"][1]
        narrator.say(f"kubectl delete pod {victim} --grace-period=0 --force  (a worker dies "
                     "without notice, its memory with it)")  # fmt: skip
        kube.kubectl("delete", "pod", victim, "--grace-period=0", "--force")
        narrator.wait(_running(3, epoch + 1), "the job recovered and back on 3 members", STARTUP)
        epoch = narrator.status()["epoch"]
        time.sleep(10)
        narrator.say("kubectl patch etj/tiny: suspend (as Kueue does to make room): the state is "
                     "saved, every pod released")  # fmt: skip
        kube.kubectl("patch", f"etj/{JOB}", "--type=merge", "-p", '{"spec":{"suspend":true}}')
        narrator.wait(lambda s: s.get("phase") == "Suspended", "the job suspended", STARTUP)
        narrator.say(f"suspended at step {narrator.status()['step']}; "
                     "resuming on 2 members, another layout")  # fmt: skip
        resume = '{"spec":{"suspend":false,"replicas":2}}'
        kube.kubectl("patch", f"etj/{JOB}", "--type=merge", "-p", resume)
        narrator.wait(_running(2, epoch), "the job resumed on 2 members", STARTUP)
        _done(kube, narrator, lambda s: f"loss {s['loss']:.4f}, epoch {s['epoch']}, {s['layout']}")
        draw_timeline(kube, timeline or cluster.run_dir("demo") / "timeline.png")
        _pods_of_two(kube, narrator)
        narrator.stop.set()
    finally:
        if not keep:
            cluster.down("demo")


def _pods_of_two(kube: Kube, narrator: Narrator) -> None:
    """The same model as a job of pods of 2 members each (as pods of 2 GPUs would be), tp=2
    inside each pod: 2 pods, then `kubectl scale` to 3."""
    narrator.say(
        f"kubectl delete etj/{JOB}; the same model in pods of 2 members each "
        "(membersPerPod: 2, one agent endpoint a pod), tp=2 inside each pod"
    )
    kube.kubectl("delete", "etj", JOB, "--wait=true", timeout=180)
    wait_until(lambda: not kube.pods(f"liveshard.io/job={JOB}") or None, 180, "the pods gone")
    body = yaml.safe_load((ROOT / "examples" / "tiny-job.yaml").read_text())
    body["spec"].update(replicas=2, membersPerPod=2, parallelism={"tp": 2, "zero": 1})
    kube.apply(body)
    narrator.wait(_running(2), "the job training in 2 pods", STARTUP)
    epoch = narrator.status()["epoch"]
    time.sleep(10)
    narrator.say(f"kubectl scale etj/{JOB} --replicas=3  (pods: 4 -> 6 members)")
    kube.kubectl("scale", f"etj/{JOB}", "--replicas=3")
    narrator.wait(_running(3, epoch), "the job in 3 pods", STARTUP)
    _done(kube, narrator, lambda s: f"{s['layout']}, members in rank order "
                                    f"{', '.join(s['members'])}")  # fmt: skip


def _done(kube: Kube, narrator: Narrator, what: Callable[[dict[str, Any]], str]) -> None:
    """After 10 s more of training: the job's step and `what` its status says, and `kubectl get
    etj`."""
    time.sleep(10)
    final = narrator.status()
    narrator.say(f"done: step {final['step']}, {what(final)}")
    print(kube.kubectl("get", "etj").stdout, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    parser.add_argument("--timeline", type=Path, metavar="FILE.png",
                        help="where to draw the job's timeline (default: timeline.png in the "
                        "demo cluster's folder, ~/.cache/liveshard/run/demo)")  # fmt: skip
    args = parser.parse_args()
    run(args.keep, args.timeline)


if __name__ == "__main__":
    main()
