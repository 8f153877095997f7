"""The control plane at scale: the real operator driving a job of 64, 256 and 1024 members.

The operator's own reconcile loop (`JobController`: observe, decide, act, status) runs in this
process, which imports no torch. Its API server is a stand-in (`SimKube`, in memory: the job,
its pods, Secrets and budget, with merge patches and resourceVersion checks), which counts the
requests; a pod it is asked to create is started as an agent at an address of its own on the
loopback (127.x.y.z) by a farm process (`control_agents`): the real agent server, its gRPC API
over mutual TLS with the certificates and token the operator issued, its status and command
inbox, a c10d store hosted when asked, around a member that trains nothing (its steps tick every
`--step-seconds` on a shared clock, and its switch is agreed through the change's store).

For each size, in one run:
- start: from the job's creation to every member training (the operator creating every pod,
  the farm starting their agents, the first world prepared and started);
- steady: one reconcile pass with nothing to do (best and median of 10), and its API requests
  and agent calls;
- shrink by 1/64 of the members (at least one pod) and grow back: from the spec change to the
  reconfiguration recorded as committed in the job's status, with the passes it took (each
  pass's seconds, in all and in its stages: `pass_stage_seconds`), the API requests and agent
  calls made meanwhile. Nothing is transferred, so this is the control
  overhead of a reconfiguration: the operator's passes, the agents' prepare, the members'
  agreement on the switch step (they switch two steps after every one is prepared: one to two
  step times of it are the step boundary, which a real job waits for too) and the commit seen;
  its parts (`parts_seconds`): until the last agent took its Prepare, then until the last
  member obeyed it (at its next step boundary), then until every member said it was prepared
  (after the step that follows), and from the switch step to the commit recorded. On a machine
  too loaded for the members to keep their clock, the switch step recorded may be one whose
  time is past (`behind_the_clock_seconds`): its wait is then none; and how long the
  operator's Prepare calls took, each (`prepare_call_seconds`: median, 90th percentile, max);
- abort: the same shrink again, but one member of the world fails to prepare it: until the
  operator recorded it aborted (its Abort calls in the pass that gave it up:
  `pass_stage_seconds`' act), and until every member that took its Prepare dropped it
  (`all_dropped_seconds`; `took_the_prepare`: one whose Prepare came too late has none);
- the operator's memory: its process's peak resident set, against before the job;
- how busy the machine was (`machine_busy_cores`, from /proc/stat: every process's CPU time,
  the agents' and the operator's, over the phase's wall time) in the start, the shrink and the
  growth, and in a few seconds with no pass after the steady passes (`members_alone`): what
  the members' steps cost the agents by themselves (the counters count 10 ms ticks: too coarse
  for the steady passes, which last a fraction of a second at small sizes);
- the job's loop with nothing to do for a few seconds (`idle_loop`): its passes, the operator's
  CPU and how busy the machine was (a pass's own write of the members' progress wakes nothing,
  and a long pass is followed by a longer wait: `JobController.wait`). Near the
  machine's core count, the figures measure a saturated machine.

A pod whose agent fails to start is said on stderr (the operator replaces it, and the run's
figures then include that); a phase that does not end within its limit fails the run with the
job's status, a line for each agent with an epoch pending or in another epoch than the
world's (`astray`), and the files in which each farm wrote the stacks of all its threads then
(`Farms.dump_stacks`: where an agent that stopped answering was stuck).

Passes run as the operator's job loop runs them: at once when the job or one of its pods
changed since the last pass began (what its watches wake it for), but for the pass's own write
while a reconfiguration is in flight; then, until the next pass, the wait follows one member of
it (`sentinel`) and ends when that member's verdict changes; else 2 s after the last pass
(`handlers.PERIOD`). Any other agent's status changing wakes nothing: the next pass sees it.

    python bench/control.py [--members 64 256 1024] [--out bench/results/control.json]
    python bench/control.py --no-resolver    # the store connects' name lookups fail at once
    python bench/control.py --members-per-pod 8    # pods of 8 members, behind the pod's proxy
"""

from __future__ import annotations

import argparse
import base64
import copy
import itertools
import json
import math
import multiprocessing as mp
import os
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from common import machine, write_json
from google.protobuf import text_format
from liveshard_operator import agents
from liveshard_operator.controller import JobController
from liveshard_operator.handlers import PERIOD
from liveshard_operator.kube import ApiError, Kube
from liveshard_operator.metrics import STAGES
from liveshard_operator.publish import merge_patch
from liveshard_operator.render import GROUP, PLURAL, VERSION

from liveshard_e2e.kubelet.env import container_env, decode_secret

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "bench"
JOB = "sim"
ALONE_SECONDS = 4.0  # the window with no pass in which the members' own load is measured
IDLE_SECONDS = 12.0  # the window in which the job's loop runs with nothing to do
JOB_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{JOB}"


class SimKube(Kube):
    """The API server's side of what the operator asks, in memory, with a kubelet that starts
    each created pod's agent in the farm (see the module's docstring)."""

    def __init__(self, farms: Farms) -> None:
        super().__init__("http://stand-in")
        self.objects: dict[str, dict[str, Any]] = {}  # by path
        # Each object's JSON, written once per change: an answer is parsed from it, the work
        # the operator's client does on a real API server's answer (`Kube.request`).
        self.texts: dict[str, str] = {}
        self.requests: Counter[str] = Counter()
        self.version = 0
        # The versions written since the last pass began, and whether there are any: what the
        # watches wake a job's loop for (`until` takes out the loop's own quiet write).
        self.news: set[str] = set()
        self.changed = threading.Event()
        self.lock = threading.Lock()
        self.farms = farms
        self.ips = (f"127.{1 + i // 250 // 250}.{i // 250 % 250}.{1 + i % 250}"
                    for i in range(1 << 24))  # fmt: skip
        self.suffixes = itertools.count(1)

    def request(self, method: str, path: str, body: Any = None, *,
                query: dict[str, Any] | None = None, content_type: str = "",
                timeout: float | None = None) -> Any:  # fmt: skip
        with self.lock:
            self.requests[method] += 1
            return self._answer(method, path.split("?")[0], body, query or {})

    def _answer(self, method: str, path: str, body: Any, query: dict[str, Any]) -> Any:
        if method == "GET" and path == "/api/v1/nodes":
            return {"items": []}
        if method == "GET" and path.endswith("/pods") and "labelSelector" in query:
            key, value = query["labelSelector"].split("=")
            items = [self.texts[p] for p, o in self.objects.items() if p.startswith(path + "/")
                     and (o["metadata"].get("labels") or {}).get(key) == value]  # fmt: skip
            return json.loads('{"items": [' + ", ".join(items) + "]}")
        if method == "POST":
            obj = copy.deepcopy(body)
            meta = obj["metadata"]
            if "name" not in meta:  # generateName, as the API server completes it
                meta["name"] = f"{meta['generateName']}{next(self.suffixes):05x}"
            name = meta["name"]
            target = f"{path}/{name}"
            if target in self.objects:
                raise ApiError(method, path, 409, f"{name} exists")
            if path.endswith("/secrets") and "stringData" in obj:
                text = obj.pop("stringData")
                obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in text.items()}
            self.put(target, obj)
            if path.endswith("/pods"):
                threading.Thread(target=self._kubelet, args=(target,), daemon=True).start()
            return json.loads(self.texts[target])
        obj = self.objects.get(path.removesuffix("/status"))
        if obj is None:
            raise ApiError(method, path, 404, "not found")
        if method == "GET":
            return json.loads(self.texts[path.removesuffix("/status")])
        if method == "DELETE":
            del self.objects[path], self.texts[path]
            if "/pods/" in path:
                self.farms.stop(obj["metadata"]["name"])
            return None
        if method == "PATCH":
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != obj["metadata"].get("resourceVersion"):
                raise ApiError(method, path, 409, "the object has been modified")
            self.put(path.removesuffix("/status"), merge_patch(obj, body))
            return json.loads(self.texts[path.removesuffix("/status")])
        raise ApiError(method, path, 405, "not served by the stand-in")

    def put(self, path: str, obj: dict[str, Any]) -> None:
        """Store `obj` at `path`; a new version (a watch event) only when it changed."""
        old = self.objects.get(path)
        if old is not None:
            obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            if obj == old:
                return
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self.objects[path] = obj
        self.texts[path] = json.dumps(obj)
        self.news.add(str(self.version))
        self.changed.set()

    def _kubelet(self, path: str) -> None:
        """Start the pod's agent, then show it Running with its IP."""
        with self.lock:
            pod = copy.deepcopy(self.objects[path])
            ip = next(self.ips)
            pod["status"] = {"podIP": ip}

            def lookup(kind: str, name: str) -> dict[str, str] | None:
                kinds = {"secretRef": "secrets", "configMapRef": "configmaps"}
                found = self.objects.get(f"/api/v1/namespaces/{NAMESPACE}/{kinds[kind]}/{name}")
                return decode_secret(found.get("data")) if found else None

            environ = container_env(pod, pod["spec"]["containers"][0], {}, lookup)
        answer = self.farms.start(pod["metadata"]["name"], environ)
        with self.lock:
            if path not in self.objects:
                return  # deleted meanwhile
            phase = "Running" if answer[0] == "ready" else "Failed"
            if phase == "Failed":  # the operator replaces it: say why, the run's figures differ
                print(f"pod {pod['metadata']['name']} failed to start: {answer[-1]}",
                      file=sys.stderr, flush=True)  # fmt: skip
            status = {
                "phase": phase,
                "podIP": ip,
                "conditions": [
                    {"type": "Ready", "status": "True" if phase == "Running" else "False"}
                ],
            }
            self.put(path, merge_patch(self.objects[path], {"status": status}))

    def job(self) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.objects[JOB_PATH])

    def scale(self, replicas: int) -> None:
        with self.lock:
            job = self.objects[JOB_PATH]
            self.put(JOB_PATH, merge_patch(job, {"spec": {"replicas": replicas}}))


class Calls:
    """Counts the operator's agent calls, by method, and keeps when the last of each returned
    (wall-clock seconds) and how long each Prepare that was taken took."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.returned: dict[str, float] = {}
        self.prepare_seconds: list[float] = []
        self.lock = threading.Lock()
        # The operator's one way to an agent, wrapped (instrumentation of this run only).
        original = agents.AgentClient._call  # noqa: SLF001

        def counted(
            client: agents.AgentClient, method: str, request: object, members: Any = ()
        ) -> object:
            with self.lock:
                self.count[method] += 1
            began = time.perf_counter()
            answer = original(client, method, request, members)
            with self.lock:
                self.returned[method] = time.time()
                if method == "Prepare":
                    self.prepare_seconds.append(time.perf_counter() - began)
            return answer

        agents.AgentClient._call = counted  # type: ignore[method-assign,assignment]  # noqa: SLF001


def record(job: dict[str, Any]) -> dict[str, Any]:
    """The job's `status.reconfiguration` (`world.Record`)."""
    return dict((job.get("status") or {}).get("reconfiguration") or {})


def training(kube: SimKube, members: int) -> bool:
    """Whether a world of `members` is committed and nothing is in flight."""
    seen = record(kube.job())
    world = seen.get("world")
    return world is not None and len(world["members"]) == members and not seen.get("inFlight")


def loop(
    kube: SimKube, controller: JobController, more: Callable[[], bool]
) -> list[dict[str, float]]:
    """Run passes as the operator's job loop does while `more()`: at once when the job or a pod
    changed since the last pass began (the watch wakes the loop) but for the pass's own quiet
    write, else when the member the wait follows has news (`sentinel`), else `PERIOD` after it
    (longer after a long pass with nothing in flight: `JobController.wait`); each pass's
    seconds, in all and in each of its stages (the operator's `pass_stage_seconds`)."""
    passes: list[dict[str, float]] = []
    kube.changed.set()
    while more():
        controller.wait(kube.changed, PERIOD)  # as `handlers.JobLoop` does after each pass
        began = time.perf_counter()
        with kube.lock:
            kube.news.clear()
            kube.changed.clear()
        stages = _stage_seconds(controller)
        controller.reconcile()
        with kube.lock:  # the pass's own quiet write wakes nothing (`JobLoop.own_write`)
            kube.news.discard(controller.executor.quiet or "")
            if not kube.news:
                kube.changed.clear()
        after = _stage_seconds(controller)
        passes.append({"seconds": round(time.perf_counter() - began, 3)})
        passes[-1].update({k: round(after[k] - stages[k], 3) for k in STAGES})
    return passes


def _stage_seconds(controller: JobController) -> dict[str, float]:
    """The seconds the controller's passes have spent in each stage so far."""
    registry = controller.metrics.registry
    return {
        stage: registry.get_sample_value(
            "liveshard_operator_pass_stage_seconds_sum", {"job": controller.job, "stage": stage}
        )
        or 0.0
        for stage in STAGES
    }


def astray(controller: JobController, seen: dict[str, Any]) -> list[str]:
    """What each agent says that has an epoch pending or is in another epoch than the world
    recorded in `seen` (`status.reconfiguration`), one line each: why a change did not end."""
    epoch = (seen.get("world") or {}).get("epoch")
    lines = []
    for member, client in sorted(controller.clients.items()):
        try:
            status = client.status()
        except agents.AgentError as err:
            lines.append(f"{member}: {err}")
            continue
        if status.HasField("pending") or status.epoch != epoch:
            lines.append(f"{member}: {text_format.MessageToString(status, as_one_line=True)}")
    return lines


def until(kube: SimKube, controller: JobController, calls: Calls, members: int,
          limit: float, aborted: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run passes as the operator's job loop does (`loop`) until a world of `members` is
    committed (`aborted`: until a change is recorded aborted); what it took."""
    requests, agent_calls = Counter(kube.requests), Counter(calls.count)
    prepares = len(calls.prepare_seconds)
    busy = _busy_seconds()
    start, cpu, wall = time.perf_counter(), time.process_time(), time.time()

    def more() -> bool:
        if time.perf_counter() - start > limit:
            job = kube.job()
            stacks = ", ".join(str(path) for path in kube.farms.dump_stacks())
            goal = "no change aborted" if aborted else f"no world of {members}"
            raise RuntimeError(
                f"{goal} after {limit} s: {json.dumps(job.get('status'))[:2000]}"
                + "".join(f"\n{line}" for line in astray(controller, record(job)))
                + f"\nthe stacks of the farms' threads (agents' servers and members): {stacks}"
            )
        if aborted:
            return not record(kube.job()).get("attempts")
        return not training(kube, members)

    passes = loop(kube, controller, more)
    pass_seconds = [p["seconds"] for p in passes]
    return {
        "began": wall,
        "prepared": calls.returned.get("Prepare", 0.0),  # when the last Prepare was taken
        "seconds": round(time.perf_counter() - start, 3),
        "operator_cpu_seconds": round(time.process_time() - cpu, 3),
        "machine_busy_cores": _busy_cores(busy, start),
        "passes": len(passes),
        "pass_seconds_total": round(sum(pass_seconds), 3),
        "pass_seconds_max": round(max(pass_seconds, default=0.0), 3),
        "pass_stage_seconds": passes,
        "api_requests": dict(kube.requests - requests),
        "agent_calls": dict(calls.count - agent_calls),
        "prepare_call_seconds": _spread(calls.prepare_seconds[prepares:]),
        "epoch": record(kube.job())["lastEpoch"],
    }


def aborted(kube: SimKube, controller: JobController, calls: Calls, pods: int) -> dict[str, Any]:
    """A change to `pods` pods that one member fails to prepare: until the operator recorded it
    aborted, and until every member of the world that took its Prepare dropped it (at its step
    boundary, told by the operator's Abort; a Prepare past its deadline may never have been
    taken). The passes go on meanwhile, as the operator's would: a member whose status the
    pass that gave the change up did not see is told by a later one."""
    world = record(kube.job())["world"]["members"]
    kube.farms.fail(world[0])
    kube.scale(pods)
    out = until(kube, controller, calls, len(world), 300, aborted=True)
    out.pop("prepared")
    began, limit, aborts = out.pop("began"), time.perf_counter() + 120, calls.count["Abort"]

    def more() -> bool:
        dropped, took, _ = kube.farms.dropped(out["epoch"])
        return dropped < took and time.perf_counter() < limit

    later = loop(kube, controller, more)
    dropped, took, last = kube.farms.dropped(out["epoch"])
    if dropped < took:
        raise RuntimeError(
            f"{dropped} of the {took} members (of {len(world)}) that took its Prepare dropped "
            "the aborted change after 120 s"
            + "".join(f"\n{line}" for line in astray(controller, record(kube.job())))
        )
    out["all_dropped_seconds"] = round(last - began, 3)
    out["took_the_prepare"] = took  # the others' Prepares came too late: nothing to drop
    out["later"] = {"passes": len(later), "aborts": calls.count["Abort"] - aborts}
    return out


def _spread(seconds: list[float]) -> dict[str, float]:
    """The median, 90th percentile and longest of `seconds` (none: {})."""
    if not seconds:
        return {}
    ranked = sorted(seconds)

    def at(q: float) -> float:
        return round(ranked[min(int(q * len(ranked)), len(ranked) - 1)], 4)

    return {"median": at(0.5), "p90": at(0.9), "max": at(1.0)}


def job_manifest(members: int, per_pod: int = 1) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-job.yaml").read_text())
    job["metadata"] = {"name": JOB, "namespace": NAMESPACE, "uid": "bench"}
    spec = job["spec"]
    pods = members // per_pod  # replicas count pods
    spec.update(replicas=pods, minReplicas=1, maxReplicas=pods, membersPerPod=per_pod)
    spec["parallelism"] = {"zero": 0, "tp": 1, "pp": 1}
    # Both sizes this run asks for divide the global batch's micro-batches: the operator keeps
    # every member (dp = members) in each.
    spec["training"].update(globalBatch=_lcm_batch(members, per_pod), microBatch=1)
    return job


def _lcm_batch(members: int, per_pod: int) -> int:
    """A global batch that dp = `members` and dp = `members` less 1/64 both divide."""
    return math.lcm(members, members - _step(members, per_pod))


def _step(members: int, per_pod: int) -> int:
    """The members a shrink removes: 1/64 of them in whole pods, at least one pod."""
    return max(1, members // 64 // per_pod) * per_pod


def _farm(conn: Any, step_seconds: float, clock_zero: float, stacks: str) -> None:
    """A farm process's entry: the agents' module (and torch) is imported there only."""
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # 127.x.y.z has no name: c10d warns of each
    from control_agents import serve_farm

    serve_farm(conn, step_seconds, clock_zero, stacks)


class Farms:
    """The processes that run the agents, `PER_FARM` at most each: in one process, a thousand
    gRPC servers' pollers wake one another, and that measures the machine, not the control
    plane."""

    PER_FARM = 128

    def __init__(self, members: int, step_seconds: float, per_pod: int) -> None:
        ctx = mp.get_context("spawn")
        zero = time.time()
        self.conns, self.procs = [], []
        # Where each farm writes its threads' stacks when asked (`stacks`).
        self.stacks = [
            Path(tempfile.gettempdir(), f"liveshard-farm-{os.getpid()}-{farm}.stacks")
            for farm in range(-(-members // self.PER_FARM))
        ]
        for stacks in self.stacks:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_farm, args=(there, step_seconds, zero, str(stacks)),
                               daemon=True)  # fmt: skip
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
        self.locks = [threading.Lock() for _ in self.conns]  # one per farm's pipe
        self.choosing = threading.Lock()  # the placement below
        self.owner: dict[str, int] = {}
        self.load = [0] * len(self.conns)  # members
        self.per_pod = per_pod

    def _ask(self, farm: int, message: tuple[Any, ...], answer: bool) -> Any:
        with self.locks[farm]:
            self.conns[farm].send(message)
            return self.conns[farm].recv() if answer else None

    def start(self, name: str, environ: dict[str, str]) -> Any:
        with self.choosing:
            farm = self.load.index(min(self.load))
            self.load[farm] += self.per_pod
            self.owner[name] = farm
        return self._ask(farm, ("start", name, environ), answer=True)

    def stop(self, name: str) -> None:
        with self.choosing:
            farm = self.owner.pop(name, None)
            if farm is not None:
                self.load[farm] -= self.per_pod
        if farm is not None:
            self._ask(farm, ("stop", name), answer=False)

    def agreed(self) -> dict[int, tuple[float, float, float]]:
        """By epoch, when the last member took its Prepare, when every member was prepared and
        when the switch step began."""
        merged: dict[int, tuple[float, float, float]] = {}
        for farm in range(len(self.conns)):
            agreed, obeyed, *_ = self._ask(farm, ("agreed",), answer=True)
            for epoch, (ready, switch) in agreed.items():
                seen = merged.get(epoch, (0.0, 0.0, 0.0))
                merged[epoch] = (max(seen[0], obeyed.get(epoch, 0.0)), max(seen[1], ready),
                                 max(seen[2], switch))  # fmt: skip
        return merged

    def dropped(self, epoch: int) -> tuple[int, int, float]:
        """How many members dropped `epoch`, how many took its Prepare, and when the last drop
        was (wall-clock)."""
        answers = [self._ask(farm, ("agreed",), answer=True) for farm in range(len(self.conns))]
        drops = [drops_by_epoch.get(epoch, (0, 0.0)) for _, _, drops_by_epoch, _ in answers]
        took = sum(took_by_epoch.get(epoch, 0) for *_, took_by_epoch in answers)
        return sum(c for c, _ in drops), took, max((t for _, t in drops), default=0.0)

    def fail(self, member: str) -> None:
        """Make `member`'s next Prepare fail (told to every farm: one of them runs it)."""
        for farm in range(len(self.conns)):
            self._ask(farm, ("fail", member), answer=False)

    def dump_stacks(self, wait: float = 60.0) -> list[Path]:
        """Have every farm write the stacks of all its threads (its agents' servers and members);
        the files written within `wait` seconds (a farm that died writes none)."""
        asked = []
        for proc, path in zip(self.procs, self.stacks, strict=True):
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
                asked.append(path)
        deadline = time.monotonic() + wait
        while not all(p.exists() for p in asked) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [path for path in asked if path.exists()]

    def close(self) -> None:
        for farm, proc in enumerate(self.procs):
            self._ask(farm, ("quit",), answer=False)
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def one_size(members: int, step_seconds: float, per_pod: int = 1) -> dict[str, Any]:
    farms = Farms(members, step_seconds, per_pod)
    kube = SimKube(farms)
    calls = Calls()
    events: Counter[str] = Counter()
    kube.put(JOB_PATH, job_manifest(members, per_pod))
    controller = JobController(kube, NAMESPACE, JOB, lambda _j, _t, reason, _m: events.update(
        [reason]))  # fmt: skip
    rss_before = _rss()
    out: dict[str, Any] = {"members": members, "members_per_pod": per_pod,
                           "step_seconds": step_seconds}  # fmt: skip
    try:
        out["start"] = until(kube, controller, calls, members, 600)
        steady, requests, agent_calls = [], Counter(kube.requests), Counter(calls.count)
        cpu = time.process_time()
        for _ in range(10):
            began = time.perf_counter()
            controller.reconcile()
            steady.append(time.perf_counter() - began)
        out["steady_pass"] = {
            "operator_cpu_seconds": round((time.process_time() - cpu) / 10, 4),
            "best_seconds": round(min(steady), 4),
            "median_seconds": round(statistics.median(steady), 4),
            "api_requests_per_pass": {k: v / 10 for k, v in (kube.requests - requests).items()},
            "agent_calls_per_pass": {k: v / 10 for k, v in (calls.count - agent_calls).items()},
        }
        busy, began = _busy_seconds(), time.perf_counter()
        time.sleep(ALONE_SECONDS)
        out["members_alone"] = {"seconds": ALONE_SECONDS,
                                "machine_busy_cores": _busy_cores(busy, began)}  # fmt: skip
        busy, began, cpu = _busy_seconds(), time.perf_counter(), time.process_time()
        idle = loop(kube, controller, lambda: time.perf_counter() - began < IDLE_SECONDS)
        out["idle_loop"] = {"seconds": round(time.perf_counter() - began, 3),
                            "passes": len(idle),
                            "operator_cpu_seconds": round(time.process_time() - cpu, 3),
                            "machine_busy_cores": _busy_cores(busy, began)}  # fmt: skip
        smaller = members - _step(members, per_pod)
        kube.scale(smaller // per_pod)
        out["shrink"] = {"to": smaller, **until(kube, controller, calls, smaller, 300)}
        kube.scale(members // per_pod)
        out["grow"] = {"to": members, **until(kube, controller, calls, members, 300)}
        out["abort"] = {"to": smaller, **aborted(kube, controller, calls, smaller // per_pod)}
        agreed = farms.agreed()
        for change in (out["start"], out["shrink"], out["grow"]):
            began, prepared = change.pop("began"), change.pop("prepared")
            if change is out["start"]:
                continue
            obeyed, ready, switch = agreed[change["epoch"]]
            # A member that records the switch step more than two steps behind the members'
            # clock (a loaded machine) records a step whose time is past: it waits for none.
            wait = max(0.0, switch - ready)
            change["step_boundary_wait_seconds"] = round(wait, 3)
            change["control_seconds"] = round(change["seconds"] - wait, 3)
            change["behind_the_clock_seconds"] = round(max(0.0, ready - switch), 3)
            # Where the control overhead goes: until the last agent took its Prepare, then until
            # the last member obeyed it (at its next step boundary), from then until every
            # member said it was prepared (each says so after its next step), and from the
            # switch step to the commit recorded.
            change["parts_seconds"] = {
                "prepares_taken": round(prepared - began, 3),
                "prepares_obeyed": round(obeyed - prepared, 3),
                "all_said_prepared": round(ready - obeyed, 3),
                "commit_seen": round(began + change["seconds"] - max(switch, ready), 3),
            }
        rss_after = _rss()
    finally:
        controller.close()
        farms.close()
    out["operator_rss_mib"] = {"before": round(rss_before / 2**20, 1),
                               "with_the_job": round(rss_after / 2**20, 1)}  # fmt: skip
    out["events"] = dict(events)
    return out


def _busy_seconds() -> float:
    """The CPU seconds every process of the machine has used since it booted (/proc/stat: all
    but idle and I/O wait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _busy_cores(busy_since: float, since: float) -> float:
    """How many cores were busy, on average, from `busy_since` (`_busy_seconds`) and `since`
    (`time.perf_counter`) to now."""
    return round((_busy_seconds() - busy_since) / (time.perf_counter() - since), 2)


def _rss() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


_NO_RESOLVER = "LIVESHARD_BENCH_NO_RESOLVER"  # set once the run is inside its namespace


def _without_resolver(argv: list[str]) -> None:
    """Run this command again in a mount namespace of its own (`unshare`, no privilege needed)
    whose /etc/resolv.conf names a DNS server that is not there: every lookup of a host name
    fails at once, as a cluster's DNS answers at once, rather than waiting on this machine's
    resolver (`bench/store.py`)."""
    conf = Path(tempfile.mkdtemp()) / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\n")  # nothing listens there: refused at once
    # bound, the file stays the namespace's /etc/resolv.conf with no name left on disk
    bind = 'mount --bind "$0" /etc/resolv.conf && rm -r "${0%/*}" && exec "$@"'
    command = ["unshare", "--mount", "--map-root-user", "sh", "-c", bind, str(conf),
               sys.executable, sys.argv[0], *argv]  # fmt: skip
    os.execvpe(command[0], command, {**os.environ, _NO_RESOLVER: "1"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="8 members (a smoke run)")
    parser.add_argument(
        "--members-per-pod", type=int, default=1,
        help="members in each pod (one per GPU of a node): the operator asks each pod for its "
        "members' statuses in one call, and sends the others' calls through its proxy",
    )  # fmt: skip
    parser.add_argument("--out", default="bench/results/control.json")
    parser.add_argument(
        "--no-resolver", action="store_true",
        help="host-name lookups fail at once instead of asking this machine's DNS server "
        "(the members' store connects look up both sides' names)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.no_resolver and not os.environ.get(_NO_RESOLVER):
        _without_resolver(argv if argv is not None else sys.argv[1:])
    assert "torch" not in sys.modules
    sizes = [8] if args.quick else args.members
    if args.members_per_pod < 1 or any(members % args.members_per_pod for members in sizes):
        parser.error(
            f"--members-per-pod={args.members_per_pod} must be at least 1 and divide every "
            f"size {sizes}"
        )
    results = []
    for members in sizes:
        result = one_size(members, args.step_seconds, args.members_per_pod)
        print(json.dumps(result), flush=True)
        results.append(result)
    assert "torch" not in sys.modules, "the operator's process imported torch"
    write_json(args.out, {"machine": machine(), "command": "python bench/control.py "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
                          "sizes": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
