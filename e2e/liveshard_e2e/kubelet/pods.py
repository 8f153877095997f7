"""One pod's life on a process-kubelet node, in one worker thread per pod: credentials, init
containers, containers, restart policy, status reports and graceful deletion.

Status goes to the API server as strategic-merge patches of ``pods/<name>/status``, so conditions
written by others (``PodScheduled``, ``DisruptionTarget``) survive; a terminal phase is never left.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from liveshard_e2e.kubelet import netns
from liveshard_e2e.kubelet.config import pod_dir, pod_tmp
from liveshard_e2e.kubelet.credentials import write_pod_credentials
from liveshard_e2e.kubelet.env import EnvError, command_line, container_env, decode_secret
from liveshard_e2e.kubelet.netns import NetworkError, PodNetwork
from liveshard_e2e.kubelet.noderuntime import NodeRuntime, gpu_request
from liveshard_e2e.kubelet.probes import run_probe
from liveshard_e2e.kubelet.runtime import Container, now_rfc3339
from liveshard_e2e.rest import ApiError

log = logging.getLogger(__name__)
T = TypeVar("T")

TICK = 0.1


class PodWorker:
    """Runs one pod until it is deleted; fed the latest pod object by the watch."""

    def __init__(self, node: NodeRuntime, pod: dict[str, Any]) -> None:
        self.node = node
        self.rest = node.rest
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.key = f"{self.namespace}/{self.name}"
        self._pod = pod
        self._wake = threading.Event()
        self._gone = threading.Event()  # the object is deleted from the API
        self._lock = threading.Lock()
        self.dir = pod_dir(node.config.run_dir, self.namespace, self.name, self.uid)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp = pod_tmp(self.uid)
        pids = node.config.state_dir / "pids"
        spec = pod["spec"]
        self.init_containers = [
            Container(c, self.dir, pids, init=True) for c in spec.get("initContainers") or []
        ]
        self.containers = [Container(c, self.dir, pids, init=False) for c in spec["containers"]]
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.pod_ip = ""
        self.phase = "Pending"
        self.start_time = now_rfc3339()
        self._conditions: dict[str, tuple[str, str, str]] = {}
        self._last_status: str = ""
        self._gpus: list[int] = []
        self._deadline: float | None = None
        self._grace: int | None = None
        self.network: PodNetwork | None = None
        self._thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)

    # --- called from the watch thread ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def deleted(self) -> None:
        self._gone.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the worker thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._lifecycle()
        except Exception:
            log.exception("pod %s: worker failed", self.key)
        finally:
            for c in self.init_containers + self.containers:
                c.signal(signal.SIGKILL)
                c.poll()
            self._release_gpus()
            if self.network is not None:
                self.network.down()
            self.node.release_ip(self.pod_ip)
            shutil.rmtree(self.tmp, ignore_errors=True)
            (self.dir / ".done").touch()

    def _release_gpus(self) -> None:
        self.node.return_gpus(self._gpus)
        self._gpus = []

    def _pod_now(self) -> dict[str, Any]:
        with self._lock:
            return self._pod

    def _terminating(self) -> bool:
        return bool(self._pod_now()["metadata"].get("deletionTimestamp"))

    def _lifecycle(self) -> None:
        if self._pod_now()["spec"].get("hostNetwork", False):
            self.pod_ip = "127.0.0.1"
        elif self.node.config.pod_network != "netns":
            self.pod_ip = self.node.allocate_ip()
        elif not self._sandbox():
            return self._finish()
        self._report()
        env_base = self._prepare()
        if env_base is None:
            return self._finish()
        for c in self.init_containers:
            if not self._run_init(c, env_base):
                return self._finish()
        while not self._gone.is_set() and not self._terminating():
            for c in self.containers:
                self._step(c, env_base)
            if self.phase in ("Succeeded", "Failed"):
                self._report()
                break
            self._report()
            self._sleep()
        self._finish()

    def _sleep(self) -> None:
        self._wake.wait(TICK)
        self._wake.clear()

    def _sandbox(self) -> bool:
        """The pod's address and network namespace (True), or False if the pod went first."""
        tag = netns.cluster_tag(self.node.config.run_dir)

        def make() -> bool:
            self.pod_ip = self.pod_ip or self.node.allocate_ip()
            self.network = PodNetwork(tag, self.uid, self.pod_ip, self.name, self.dir)
            self.network.up()
            for c in self.init_containers + self.containers:
                c.waiting = ("ContainerCreating", "")
            return True

        made = self._retried(make, (NetworkError,), "CreatePodSandboxError", "no network namespace")
        return made is not None

    def _prepare(self) -> dict[str, str] | None:
        """Token, kubeconfig and base environment, or None if the pod went first."""
        return self._retried(
            self._credentials, (ApiError, EnvError), "CreateContainerConfigError",
            "not ready to start",
        )  # fmt: skip

    def _retried(self, attempt: Callable[[], T], errors: tuple[type[Exception], ...], reason: str,
                 what: str) -> T | None:  # fmt: skip
        """`attempt()`, retried every second as a kubelet retries a pod's sandbox and its
        containers' configuration, until it returns or the pod goes (None); meanwhile every
        container waits with `reason` and the error."""
        while not self._gone.is_set() and not self._terminating():
            try:
                return attempt()
            except errors as err:
                for c in self.init_containers + self.containers:
                    c.waiting = (reason, str(err)[:300])
                log.warning("pod %s: %s: %s", self.key, what, err)
                self._report()
                self._wake.wait(1.0)
                self._wake.clear()
        return None

    def _credentials(self) -> dict[str, str]:
        env = dict(self.node.base_env)
        env["HOSTNAME"] = self.name
        self.tmp.mkdir(mode=0o700, exist_ok=True)
        env["TMPDIR"] = str(self.tmp)  # a container's own TMPDIR in its spec wins
        # In a namespace of its own, the pod reaches the host's API server at the gateway.
        host = "127.0.0.1" if self.network is None else netns.GATEWAY
        env.update(self.node.config.api_env(host))
        spec = self._pod_now()["spec"]
        if spec.get("automountServiceAccountToken", True):
            account = spec.get("serviceAccountName") or "default"
            env["KUBECONFIG"] = str(
                write_pod_credentials(
                    self.rest,
                    self.node.config,
                    self.namespace,
                    self.name,
                    self.uid,
                    account,
                    self.dir,
                    host,
                )
            )
        return env

    def _lookup(self, kind: str, name: str) -> dict[str, str] | None:
        resource = "configmaps" if kind == "configMapRef" else "secrets"
        try:
            obj = self.rest.get(f"/api/v1/namespaces/{self.namespace}/{resource}/{name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        if resource == "secrets":
            return decode_secret(obj.get("data"))
        return dict(obj.get("data") or {})

    def _start(self, c: Container, env_base: dict[str, str]) -> bool:
        pod = self._pod_now()
        # The watch may not have brought back the pod IP this kubelet reported itself yet; the
        # downward API must never see it empty.
        status = {
            **(pod.get("status") or {}),
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
        }
        pod = {**pod, "status": status}
        try:
            env = container_env(pod, c.spec, env_base, self._lookup, self.node.spec.capacity())
            argv = command_line(c.spec, env)
            wanted = gpu_request(c.spec)
            if wanted and not c.restart_count:
                self._gpus += self.node.take_gpus(wanted)
            ids = ",".join(str(i) for i in self._gpus[-wanted:]) if wanted else ""
            env.setdefault("CUDA_VISIBLE_DEVICES", ids)
            env.setdefault("NVIDIA_VISIBLE_DEVICES", ids or "void")
            c.start(self._wrap(argv, c), env)
            return True
        except (EnvError, ApiError, OSError) as err:
            kind = "RunContainerError" if isinstance(err, OSError) else "CreateContainerConfigError"
            c.waiting = (kind, str(err)[:300])
            log.info("pod %s: container %s cannot start: %s", self.key, c.name, err)
            return False
        except Exception as err:  # a kubelet bug must show on the pod, not hang it silently
            c.waiting = ("CreateContainerError", f"process kubelet error: {err!r}"[:300])
            log.exception("pod %s: container %s cannot start", self.key, c.name)
            return False

    def _wrap(self, argv: list[str], c: Container) -> list[str]:
        """``argv`` as run in the pod's network namespace, where it has one (with the container's
        read-only root filesystem, if it asks for one: `PodNetwork.wrap`)."""
        if self.network is None:
            return argv
        if not (c.spec.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            return self.network.wrap(argv)
        mounts = c.spec.get("volumeMounts") or []
        return self.network.wrap(argv, [m["mountPath"] for m in mounts if not m.get("readOnly")])

    def _run_init(self, c: Container, env_base: dict[str, str]) -> bool:
        """Runs an init container to success; False when the pod must stop (failure with
        restartPolicy Never, deletion)."""
        while not self._gone.is_set() and not self._terminating():
            if c.proc is None and time.monotonic() >= c.next_start and not self._start(c, env_base):
                c.next_start = time.monotonic() + 1
            if c.poll():
                assert c.terminated is not None
                if c.terminated["exitCode"] == 0:
                    self._report()
                    return True
                if self.restart_policy == "Never":
                    self.phase = "Failed"
                    self._report()
                    return False
                c.schedule_restart()
            self._report()
            self._sleep()
        return False

    def _probe(self, c: Container) -> None:
        """Runs whichever of the container's probes is due; a failed startup or liveness probe
        kills the container (then the restart policy applies)."""
        now = time.monotonic()
        if not c.running:
            return
        # Liveness and readiness wait until the startup probe has succeeded.
        checks = [("startup", c.startup)] if not c.startup.ok else []
        checks = checks or [("liveness", c.liveness), ("readiness", c.readiness)]
        for kind, tracker in checks:
            if not tracker.due(now) or tracker.probe is None:
                continue
            wrap = functools.partial(self._wrap, c=c)
            tracker.record(run_probe(tracker.probe, c.spec, self.pod_ip, c.env, wrap), now)
            if tracker.failed and kind != "readiness":
                log.info("pod %s: container %s failed its %s probe", self.key, c.name, kind)
                c.signal(signal.SIGKILL)
                return

    def _step(self, c: Container, env_base: dict[str, str]) -> None:
        self._probe(c)
        if c.poll():
            assert c.terminated is not None
            failed = c.terminated["exitCode"] != 0
            if self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and failed):
                c.schedule_restart()
        if c.proc is None and c.terminated is None and time.monotonic() >= c.next_start:
            if self._start(c, env_base):
                self.phase = "Running"
            else:
                c.next_start = time.monotonic() + 1
        if all(x.terminated is not None for x in self.containers):
            ok = all(x.terminated and x.terminated["exitCode"] == 0 for x in self.containers)
            self.phase = "Succeeded" if ok else "Failed"

    # --- deletion ----------------------------------------------------------------------------
    def _finish(self) -> None:
        """Graceful termination once the pod has a deletion timestamp (or is gone): preStop,
        SIGTERM, SIGKILL at the deadline, final status, then DELETE with grace 0 and our UID.
        A terminated pod's devices are free at once, as the scheduler counts them."""
        if self.phase in ("Succeeded", "Failed"):
            self._release_gpus()
        while not self._gone.is_set() and not self._terminating():
            self._wake.wait(1.0)  # terminal phase: idle until deleted (an update wakes it)
            self._wake.clear()
        everything = self.init_containers + self.containers
        if self._gone.is_set():
            for c in everything:
                c.signal(signal.SIGKILL)
            return
        self._arm_deadline()
        hooks = [
            threading.Thread(target=self._stop_container, args=(c,), daemon=True)
            for c in everything
            if c.running
        ]
        for t in hooks:
            t.start()
        killed = False
        while any(c.running for c in everything):
            for c in everything:
                c.poll()
            self._arm_deadline()
            if not killed and self._deadline is not None and time.monotonic() >= self._deadline:
                log.info("pod %s: grace period over; SIGKILL", self.key)
                for c in everything:
                    c.signal(signal.SIGKILL)
                killed = True
            if self._gone.is_set():
                for c in everything:
                    c.signal(signal.SIGKILL)
            self._sleep()
        if self.phase not in ("Succeeded", "Failed"):
            ok = all(c.terminated and c.terminated["exitCode"] == 0 for c in self.containers)
            self.phase = "Succeeded" if ok else "Failed"
        if self._gone.is_set():
            return
        self._report()
        try:
            self.rest.delete(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
            log.info("pod %s: deleted", self.key)
        except ApiError as err:
            if err.status not in (404, 409):
                raise

    def _arm_deadline(self) -> None:
        """Deadline = when we saw the deletion + its grace; a later shorter grace shortens it."""
        grace = self._pod_now()["metadata"].get("deletionGracePeriodSeconds")
        grace = 30 if grace is None else int(grace)
        if self._grace is None or grace < self._grace:
            candidate = time.monotonic() + grace
            self._deadline = candidate if self._deadline is None else min(self._deadline, candidate)
            self._grace = grace

    def _stop_container(self, c: Container) -> None:
        hook = ((c.spec.get("lifecycle") or {}).get("preStop")) or {}
        remaining = max(0.0, (self._deadline or time.monotonic()) - time.monotonic())
        try:
            if "exec" in hook:  # in the container, as an exec probe: its environment, its netns
                subprocess.run(
                    self._wrap(list(hook["exec"]["command"]), c),
                    env=c.env,
                    timeout=remaining,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
            elif "sleep" in hook:
                time.sleep(min(remaining, float(hook["sleep"]["seconds"])))
            elif "httpGet" in hook:
                get = hook["httpGet"]
                url = f"http://{get.get('host') or self.pod_ip}:{get['port']}{get.get('path', '/')}"
                urllib.request.urlopen(url, timeout=remaining).close()
        except Exception as err:
            log.info("pod %s: preStop hook of %s failed: %s", self.key, c.name, err)
        c.stopping = True
        c.signal(signal.SIGTERM)

    # --- status ------------------------------------------------------------------------------
    def _condition(self, kind: str, ok: bool, reason: str = "") -> dict[str, str]:
        status = "True" if ok else "False"
        previous = self._conditions.get(kind)
        since = previous[2] if previous and previous[0] == status else now_rfc3339()
        self._conditions[kind] = (status, reason, since)
        cond = {"type": kind, "status": status, "lastTransitionTime": since}
        if reason:
            cond["reason"] = reason
        return cond

    def _report(self) -> None:
        """Patches the pod's status when it changed since the last report."""
        if self._gone.is_set():
            return
        init_done = all(
            c.terminated and c.terminated["exitCode"] == 0 for c in self.init_containers
        )
        terminal = self.phase in ("Succeeded", "Failed")
        ready = not terminal and all(c.ready for c in self.containers)
        not_ready = "PodCompleted" if terminal else "ContainersNotReady"
        status: dict[str, Any] = {
            "phase": self.phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            **({"podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}]} if self.pod_ip else {}),
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", not terminal),
                self._condition(
                    "Initialized", init_done, "" if init_done else "ContainersNotInitialized"
                ),
                self._condition("ContainersReady", ready, "" if ready else not_ready),
                self._condition("Ready", ready, "" if ready else not_ready),
            ],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        text = json.dumps(status, sort_keys=True)
        if text == self._last_status:
            return
        try:
            self.rest.patch(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                # metadata.uid acts as a precondition: never patch a re-created namesake.
                {"metadata": {"uid": self.uid}, "status": status},
            )
            self._last_status = text
        except ApiError as err:
            # A re-created namesake refuses our uid with 422 ("metadata.uid ... immutable").
            if err.status in (404, 409) or (err.status == 422 and "metadata.uid" in err.body):
                self._gone.set()
            else:
                log.warning("pod %s: status patch failed: %s", self.key, err)
