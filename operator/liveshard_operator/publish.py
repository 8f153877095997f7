"""The job's status as one pass leaves it, computed in memory from what the pass saw and decided:
the world in effect, how many members train, the phase and conditions, the last reconfiguration's
summary, the record the next pass reads (`status.reconfiguration`), the last checkpoint saved and
the last that failed (`checkpoints`), the job's progress (`status.progress`: a bounded series
of its step, loss and tokens per second, which `liveshard timeline --job` draws), and its
pipeline's measured imbalance with what rebalancing remembers (`status.imbalance`,
`status.rebalance`, `status.released`). The executor
writes it as one merge patch: a key the patch leaves out (the history, the progress) keeps what
the last write gave it.

Pure: the time is the pass's, given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.assign.nodes import mirror_pairs, pairs_on_one_node
from liveshard_core.job import Result

from . import checkpoints, policy, render
from .conditions import Conditions, seconds, stamp
from .observation import Job, Observation, trains_in
from .world import InFlight, Record, World

HISTORY = 20  # reconfigurations kept in status.history, the latest last
# What the status says of the training as it goes, which moves at every step: a write that
# changes nothing else is no news to the job's loop (`news`).
PROGRESS_FIELDS = frozenset({"step", "loss", "progress", "stateBytes", "peerExchangeSeconds",
                             "imbalance"})  # fmt: skip
PROGRESS = 200  # samples kept in status.progress; every other one dropped when it is full
# Seconds at least between two samples: passes can come a tenth of a second apart, and a rate
# over so short a time is mostly the noise of where the steps fall.
SAMPLE_SECONDS = 1.0


@dataclass(frozen=True)
class Summary:
    """How a reconfiguration ended (`status.lastReconfiguration`)."""

    epoch: int
    reason: str
    old: str  # the layout it started from ("": none, a first world)
    new: str
    result: Result
    message: str
    pause_seconds: float = 0.0
    bytes_moved: int = 0

    @classmethod
    def of(cls, plan: InFlight, result: Result, message: str, **measured: Any) -> Summary:
        old = plan.old.describe() if plan.old else ""
        return cls(plan.epoch, plan.reason, old, plan.new.describe(), result, message, **measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "reason": self.reason, "from": self.old, "to": self.new,
            "pauseSeconds": self.pause_seconds, "bytesMoved": self.bytes_moved,
            "result": self.result.value, "message": self.message,
        }  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """Why the job cannot go on (the Failed condition's reason and message)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Missing:
    """Pods the job goes on without: none of them can be scheduled or become ready in time, or
    they failed to start (the Degraded condition's reason and message)."""

    reason: str  # the scheduler's (Unschedulable, ...), PendingTimeout, or WorkerCrashing
    message: str


@dataclass(frozen=True)
class Report:
    """What a pass concluded that the status tells beyond the record."""

    message: str = ""  # the Ready and Degraded conditions' message
    spares: tuple[str, ...] = ()  # ready pods no layout uses
    last: Summary | None = None  # the reconfiguration this pass ended
    failure: Failure | None = None
    finished: bool = False  # the job trained its last step
    exported: str = ""  # the Hugging Face directory its last step was exported to
    missing: Missing | None = None


def _state_bytes(agents: list[pb.AgentStatus | None]) -> dict[str, int] | None:
    """The most training state a member of the world holds, and of it the most a mirrored
    layout's copies add (`faultTolerance.snapshots`); None (removed) when no member trains."""
    held = [a for a in agents if a is not None and a.state_bytes]
    if not held:
        return None
    return {"perMember": max(int(a.state_bytes) for a in held),
            "mirroredPerMember": max(int(a.mirrored_bytes) for a in held)}  # fmt: skip


def _exposed(
    world: World | None, placement: dict[str, int] | None, seen: Observation
) -> str | None:
    """Why a node's loss would take both copies of a shard, when mirror pairs share a node and
    no exchange of members parts any (the pods are on too few nodes); else None (an exchange
    that helps is made live: `decide`)."""
    if world is None or not placement or not placement["mirrorPairsOnOneNode"]:
        return None
    if policy.respread(world.degrees, world.members, seen.nodes(), bool(seen.pod_of())):
        return None
    return (
        f"{placement['mirrorPairsOnOneNode']} of {placement['mirrorPairs']} mirror pairs share a "
        f"node, on {placement['nodes']} node(s), and no exchange of members parts them: such a "
        "node's loss takes both copies of a shard, which only a checkpoint restores; spread the "
        "workers over more nodes"
    )


def _placement(job: Job, world: World, seen: Observation) -> dict[str, int]:
    """Over how many nodes the world's members are, and how many of its mirror pairs (two
    members holding copies of one ZeRO shard) share one: a node's loss is recovered in memory
    when none of them are on it."""
    layout, node_of = world.layout(job.model), seen.nodes()
    return {
        "nodes": len({node_of[m] for m in world.members if m in node_of}),
        "mirrorPairs": len(mirror_pairs(layout)),
        "mirrorPairsOnOneNode": pairs_on_one_node(layout, layout.members, node_of),
    }


def status(
    job: Job, seen: Observation, record: Record, report: Report, now: float
) -> dict[str, Any]:
    """The status patch of a pass that leaves `record` and concluded `report`."""
    conds = Conditions(job.status.get("conditions") or [], job.generation, now)
    world, plan, pods = record.world, record.in_flight, seen.pods
    out: dict[str, Any] = {
        "observedGeneration": job.generation,
        "selector": render.selector(job.name),
        "replicas": job.spec.pods(len(world.members)) if world else 0,  # the scale's: pods
    }
    training: list[str] = []
    if world is not None:
        training = [m for m in world.members if m in pods and trains_in(pods[m].agent, world.epoch)]
        speaker = pods.get(world.members[0])
        if speaker is not None and speaker.agent is not None:
            out["step"] = int(speaker.agent.step)
            loss = _loss(world, seen)
            if loss is not None:
                out["loss"] = loss
            if trains_in(speaker.agent, world.epoch) and loss is not None:
                progress = _progress(job, world, speaker.agent, loss, now)
                if progress is not None:
                    out["progress"] = progress
        out.update(epoch=world.epoch, layout=world.describe(), members=list(world.members))
    out["stateBytes"] = _state_bytes([pods[m].agent for m in training])
    exchanges = [pods[m].agent.exchange_seconds for m in training]  # type: ignore[union-attr]
    out["peerExchangeSeconds"] = round(max(exchanges), 6) if any(exchanges) else None
    out["placement"] = _placement(job, world, seen) if world is not None else None
    out["readyReplicas"] = job.spec.pods(len(training))
    out["spares"] = list(report.spares)
    if report.last is not None:
        out["lastReconfiguration"] = report.last.to_dict()
        out["history"] = _history(job, out, now)
    message = report.message
    if report.failure is not None:
        phase = "Failed"
        conds.set("Failed", True, report.failure.reason, report.failure.message)
    elif report.finished:
        phase = "Succeeded"
        trained = f"trained {job.spec.training.steps} steps"
        conds.set("Succeeded", True, "Trained", "; ".join(filter(None, (trained, message))))
        if report.exported:
            out["exportedTo"] = report.exported
    elif plan is not None:
        phase = "Reconfiguring"
    elif world is not None:
        phase = "Running"
    elif job.spec.suspend:
        phase = "Suspended"
    else:
        phase = "Pending"
    saved = record.suspended if world is None and record.suspended else None
    if saved is not None and saved.saved:
        out["step"] = saved.step
    if phase == "Suspended":
        kept = "suspended before it started: no pod is kept"
        if saved is not None and saved.saved:
            kept = f"the state of step {saved.step} is saved in {saved.path}"
        conds.set("Suspended", True, "JobSuspended", kept)
    elif conds.get("Suspended") is not None:
        conds.set("Suspended", False, "JobResumed", "")
    conds.set("Ready", phase == "Running", phase, message or f"{len(training)} members training")
    conds.set("Reconfiguring", plan is not None, "InFlight" if plan else "Idle",
              f"epoch {plan.epoch}: {plan.reason}" if plan else "")  # fmt: skip
    failed = checkpoints.last_failed(job, seen, now)
    if report.last is not None and report.last.result is Result.ABORTED:
        conds.set("Degraded", True, "ReconfigurationAborted", report.last.message)
    elif report.missing is not None:
        conds.set("Degraded", True, report.missing.reason, report.missing.message)
    elif failed is not None:
        conds.set("Degraded", True, "CheckpointFailed", failed.describe())
    elif report.spares:
        conds.set("Degraded", True, "HotSpares", message)
    elif (exposed := _exposed(world, out["placement"], seen)) is not None:
        conds.set("Degraded", True, "MirrorPairsOnOneNode", exposed)
    else:
        conds.set("Degraded", False, "AsPlanned", message)
    out.update(phase=phase, conditions=conds.items, reconfiguration=record.to_dict())
    out.update(checkpoints.status(job, seen, now))
    out.update(record.rebalance.to_status())
    costs = measured(seen, world) if world is not None else None
    out["imbalance"] = round(costs.imbalance, 4) if costs is not None else None
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """`target` as the API server leaves it after the merge patch `patch` (RFC 7386)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def news(before: dict[str, Any], patch: dict[str, Any]) -> bool:
    """Whether the status patch `patch` changes the status `before` in more than its
    `PROGRESS_FIELDS`: the job's loop is woken by a write that does (its own pass's), not by one
    that only says how far the training got, which the next pass reads anyway."""
    after = merge_patch(before, patch)
    return any(after.get(k) != before.get(k) for k in {*after, *before} - PROGRESS_FIELDS)


def measured(seen: Observation, world: World) -> pb.Costs | None:
    """The job's compute costs as the world's members measure them (every member reports the
    same job-wide values: the first's, rank 0, or else any member's that trains in the world's
    epoch), or None before a step of this world was measured."""
    for member in world.members:
        pod = seen.pods.get(member)
        agent = pod.agent if pod is not None else None
        if (agent is not None and agent.epoch == world.epoch and trains_in(agent, world.epoch)
                and agent.HasField("costs") and agent.costs.steps > 0):  # fmt: skip
            return agent.costs
    return None


def _history(job: Job, out: dict[str, Any], now: float) -> list[dict[str, Any]]:
    """status.history with the reconfiguration this pass ended appended (once), at most
    HISTORY entries."""
    entry = {**out["lastReconfiguration"], "step": out.get("step", 0), "time": stamp(now)}
    history = list(job.status.get("history") or [])
    key = ("epoch", "result")
    if history and all(history[-1].get(k) == entry[k] for k in key):
        return history
    return [*history, entry][-HISTORY:]


def _loss(world: World, seen: Observation) -> float | None:
    """The loss of the last step trained, as the first member of `world` that trained one
    reports it (None: none did yet). A member that joined in this world reports none until its
    first step, and its 0 would read as a fall of the loss."""
    for member in world.members:
        pod = seen.pods.get(member)
        if pod is not None and pod.agent is not None and pod.agent.loss:
            return round(float(pod.agent.loss), 6)
    return None


def _progress(
    job: Job, world: World, speaker: pb.AgentStatus, loss: float, now: float
) -> list[dict[str, Any]] | None:
    """status.progress with a sample of this pass appended, or None when the step has not
    advanced past the last sample's, or the last sample is not SAMPLE_SECONDS old and of the
    same layout (the patch then leaves the series as it is): the first sample in a new layout
    is taken by the pass that saw its reconfiguration end, where the history puts it.

    A sample is the speaker's step (the next one to train) and `loss` (of the step before), the
    world's layout and member count, and the tokens per second since the last sample: the
    steps trained since then times the tokens of a step (global batch x sequence length) over
    the seconds between the two passes, a reconfiguration's pause included. Full, the series
    drops every other sample before it takes the new one: it keeps the job's whole span, the
    latest part the densest.
    """
    samples = list(job.status.get("progress") or [])
    step = int(speaker.step)
    last = samples[-1] if samples else None
    if step <= 0:
        return None
    # A sample's time that cannot be read is infinitely late: the next sample is taken,
    # without a rate.
    since = now - seconds(str(last.get("time", "")), float("inf")) if last is not None else 0.0
    if last is not None:
        soon = 0 <= since < SAMPLE_SECONDS and last.get("layout") == world.describe()
        if step <= int(last.get("step", 0)) or soon:
            return None
    sample: dict[str, Any] = {
        "time": _precise_stamp(now), "step": step, "loss": loss,
        "members": len(world.members), "layout": world.describe(),
    }  # fmt: skip
    if last is not None and since > 0:  # not behind the last sample (a clock set back)
        training = job.spec.training
        tokens = (step - int(last["step"])) * training.global_batch * training.seq_len
        sample["tokensPerSecond"] = round(tokens / since, 1)
    while len(samples) >= PROGRESS:
        samples = samples[::2]
    return [*samples, sample]


def _precise_stamp(now: float) -> str:
    """A timestamp to the millisecond: samples can be a second apart, and their rates are
    taken over the time between them."""
    moment = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds")
    return moment.replace("+00:00", "Z")


def not_runnable(body: dict[str, Any], error: str, now: float, reason: str = "InvalidSpec"
                 ) -> dict[str, Any]:  # fmt: skip
    """The status patch of a job that cannot be run (its spec, or `reason`, such as its
    certificates not issued yet): Pending, saying why."""
    generation = int(body["metadata"].get("generation", 0))
    conds = Conditions((body.get("status") or {}).get("conditions") or [], generation, now)
    conds.set("Ready", False, reason, error)
    conds.set("Degraded", True, reason, error)
    return {"phase": "Pending", "conditions": conds.items, "observedGeneration": generation}
