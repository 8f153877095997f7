"""Agents as real processes for the server's tests: `liveshard-agent` started with subprocess and
configured by environment variables on 127.0.0.1, each on a port of its own, driven over gRPC.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_e2e.procs import free_port

AGENT = str(Path(sys.executable).parent / "liveshard-agent")
HOST = "127.0.0.1"
TOKEN = "test-token-0123456789abcdef"
# Short jobs: the built-in tiny Qwen3 (exportable), a small global batch (dp 1, 2 or 4 divide
# it), short samples.
TRAINING = {"global_batch": 4, "micro_batch": 1, "seq_len": 32, "steps": 100_000}
CONFIG = {
    "model": {"preset": "qwen3-tiny"},
    "training": TRAINING,
    "deadlines": {"op": 20, "switch": 60, "prepare": 90},
}
WAIT = 90.0  # seconds any awaited condition may take on a loaded 2-core machine
START_WAIT = 120.0  # several agents importing torch at once on 2 cores

Phase = pb.AgentStatus.Phase


def agent_env(member: str, port: int, **overrides: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVESHARD_")}
    env.update(
        LIVESHARD_JOB="test-job", LIVESHARD_MEMBER=member, LIVESHARD_POD_IP=HOST,
        LIVESHARD_PORT=str(port), LIVESHARD_TOKEN=TOKEN, LIVESHARD_CONFIG=json.dumps(CONFIG),
        OMP_NUM_THREADS="1",  # several agents share 2 cores
    )  # fmt: skip
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def layout(members: list[str], **degrees: Any) -> pb.Layout:
    """A layout of `tiny` (4 layers), its stages balanced as the agent reports them."""
    values = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "zero": 0, **degrees}
    if "pp_layers" not in values and 1 <= values["pp"] <= 4:
        pp = values["pp"]
        values["pp_layers"] = [4 // pp + (1 if s < 4 % pp else 0) for s in range(pp)]
    return pb.Layout(members=members, **values)


class Agent:
    """One `liveshard-agent` process and a client of its API."""

    def __init__(self, member: str, log_dir: Path, **env: Any) -> None:
        self.member = member
        self.env = env
        self.log_path = log_dir / f"{member}.log"
        self.log = self.log_path.open("wb")
        self.metadata = (("authorization", f"Bearer {TOKEN}"),)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [AGENT], env=agent_env(self.member, self.port, **self.env), stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.channel = grpc.insecure_channel(f"{HOST}:{self.port}")
        self.stub = pb_grpc.AgentStub(self.channel)  # type: ignore[no-untyped-call]  # generated

    def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("metadata", self.metadata)
        kwargs.setdefault("timeout", 30)
        return getattr(self.stub, method)(request, **kwargs)

    def status(self) -> pb.AgentStatus:
        status: pb.AgentStatus = self.call("GetStatus", pb.GetStatusRequest())
        return status

    def refused(self, method: str, request: Any, **kwargs: Any) -> grpc.RpcError:
        """The error a call ends with (failing the test if it succeeds)."""
        try:
            self.call(method, request, **kwargs)
        except grpc.RpcError as err:
            return err
        raise AssertionError(f"{self.member}: {method}({request}) was accepted")

    def wait_ready(self, timeout: float = START_WAIT) -> pb.AgentStatus:
        deadline, restarts = time.monotonic() + timeout, 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and restarts and self._port_taken():
                restarts -= 1
                self.channel.close()
                self._start()
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.member} exited with {self.proc.returncode}:\n"
                                     f"{self.output()}")  # fmt: skip
            try:
                status: pb.AgentStatus = self.call("GetStatus", pb.GetStatusRequest(), timeout=2)
                if status.ready:
                    return status
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            time.sleep(0.2)
        raise AssertionError(f"{self.member} not ready after {timeout} s:\n{self.output()}")

    def _port_taken(self) -> bool:
        """Whether the agent could not bind its port: another process took it between
        `free_port` and the agent's bind."""
        return f"cannot serve on {HOST}:{self.port}" in self.output()

    def wait_for(
        self, what: str, check: Callable[[pb.AgentStatus], bool], timeout: float = WAIT
    ) -> pb.AgentStatus:
        """The first status (polled) for which `check` holds."""
        deadline = time.monotonic() + timeout
        status = self.status()
        while not check(status):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.member}: {what} not reached in {timeout} s; status:\n{status}\n"
                    f"log:\n{self.output()}"
                )
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.member} exited: {self.output()}")
            time.sleep(0.1)
            status = self.status()
        return status

    def wait_exit(self, timeout: float = WAIT) -> int:
        return self.proc.wait(timeout)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@contextmanager
def agents(names: list[str], log_dir: Path, **env: Any) -> Iterator[dict[str, Agent]]:
    """Agents started together (their start-ups overlap), ready when this yields."""
    started = {name: Agent(name, log_dir, **env) for name in names}
    try:
        for agent in started.values():
            agent.wait_ready()
        yield started
    finally:
        for agent in started.values():
            agent.close()
