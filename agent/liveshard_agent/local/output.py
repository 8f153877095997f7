"""What `liveshard-local` prints: one JSON line per event, or a progress view on a terminal.

This is the launcher's one output boundary: the members' typed events (`runtime.events`) become the
lines users and scripts read here, and nowhere else. A line is a dict with `"event"`: `step`,
`samples` (with `LocalJob.record_samples`), `switch`, `checkpoint`, `broken` (a member whose world
broke), `lost` (a member whose process died), `silent` (one killed for saying nothing), `restored`
(a restart from a checkpoint) or `unmade` (a switch the job ended before); results and causes are
spelled as their string values. The format is stable: the tests, the benchmarks and the demo read
it. This module must not decide anything about the job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from liveshard_core.job import Result
from liveshard_core.policy.rebalance import StepCosts, imbalance, stage_times

from ..runtime.events import Broke, Checkpointed, CheckpointFailed, Stepped, Switched

Line = dict[str, Any]


def step_line(event: Stepped, tokens: int) -> Line:
    """A step of the world rank 0 speaks for; `tokens`: the job's tokens per step."""
    record = event.record
    return {
        "event": "step", "step": record.step, "loss": record.loss, "layout": event.layout,
        "epoch": event.epoch, "step_seconds": round(record.seconds, 6), "tokens": tokens,
        "aux_loss": record.aux_loss, "grad_norm": record.grad_norm, "lr": record.lr,
        "exchange_seconds": round(record.exchange_seconds, 6),
        **costs_fields(record.costs, event.pp_layers),
    }  # fmt: skip


def costs_fields(costs: StepCosts, pp_layers: tuple[int, ...]) -> Line:
    """A step's measured compute seconds: per pipeline stage and per layer (with the embedding's
    and the head's), and the stages' imbalance (the slowest over the mean)."""
    if not costs.layers or not pp_layers:
        return {}
    stages = stage_times(costs, pp_layers)
    return {
        "stage_seconds": [round(s, 6) for s in stages],
        "imbalance": round(imbalance(costs, pp_layers), 4),
        "layer_seconds": [round(s, 6) for s in costs.layers],
        "first_seconds": round(costs.first, 6), "last_seconds": round(costs.last, 6),
    }  # fmt: skip


def samples_line(event: Stepped) -> Line:
    """The samples one member fed in at a step."""
    record = event.record
    return {"event": "samples", "step": record.step, "member": event.member,
            "samples": list(record.samples)}  # fmt: skip


def switch_line(event: Switched) -> Line:
    line: Line = {
        "event": "switch", "epoch": event.epoch, "step": event.step,
        "result": event.result.value, "cause": event.cause.value if event.cause else None,
        "reason": event.reason, "pause_seconds": event.pause_seconds,
        "prepare_seconds": event.prepare_seconds, "network_bytes": event.network_bytes,
        "lost": list(event.lost), "from": event.from_layout, "to": event.to_layout,
    }  # fmt: skip
    if event.checksums:
        line["checksums"] = dict(event.checksums)
    line["switch_seconds"] = dict(event.switch_seconds)
    return line


def checkpoint_line(event: Checkpointed | CheckpointFailed) -> Line:
    """A checkpoint saved (`"result": "saved"`, with its seconds) or not (`"failed"`, with the
    reason every member gave): the job trains on either way."""
    line: Line = {"event": "checkpoint", "number": event.number, "step": event.step,
                  "path": event.path}  # fmt: skip
    if isinstance(event, CheckpointFailed):
        return {**line, "result": "failed", "reason": event.reason}
    return {**line, "result": "saved", "seconds": event.seconds}


def restored_line(saved: Checkpointed, epoch: int, why: str) -> Line:
    """The job restarted from checkpoint `saved` (fresh processes, epoch `epoch`) because `why`."""
    return {"event": "restored", "epoch": epoch, "step": saved.step, "path": saved.path,
            "reason": why}  # fmt: skip


def broken_line(event: Broke) -> Line:
    b = event.breakage
    return {"event": "broken", "member": event.member, "epoch": event.epoch, "step": b.step,
            "whole": b.whole, "reason": b.reason, "unfinished": b.unfinished}  # fmt: skip


def lost_line(member: str, exit_code: int | None) -> Line:
    """A member whose process died (`exit_code`: negative for a signal, as `multiprocessing`)."""
    return {"event": "lost", "member": member, "exit_code": exit_code}


def silent_line(member: str, seconds: float) -> Line:
    """A member that said nothing for `seconds` after its peers' world broke: it is killed."""
    return {"event": "silent", "member": member, "seconds": seconds}


def unmade_line(to: str, step: int, last: int) -> Line:
    """A switch to `to` asked for at `step` that the job ended before making (at step `last`)."""
    return {"event": "unmade", "step": step, "to": to,
            "reason": f"the job ended at step {last} before every member was ready"}  # fmt: skip


def printer(as_json: bool) -> Callable[[Line], None]:
    """JSON lines, or a human-readable progress view of the same lines."""

    def emit(line: Line) -> None:
        if as_json:
            print(json.dumps(line), flush=True)
        elif line["event"] == "step":
            rate = line["tokens"] / max(line["step_seconds"], 1e-9)
            print(f"step {line['step']:>5}  loss {line['loss']:.4f}  epoch {line['epoch']}  "
                  f"{line['layout']}  {line['step_seconds'] * 1000:.0f} ms  "
                  f"{rate:,.0f} tokens/s", flush=True)  # fmt: skip
        elif line["event"] == "lost":
            print(f"== member {line['member']} died (exit code {line['exit_code']})", flush=True)
        elif line["event"] == "silent":
            print(f"== member {line['member']} silent for {line['seconds']} s: killed",
                  flush=True)  # fmt: skip
        elif line["event"] == "broken":
            print(f"   {line['member']}: world broke at step {line['step']}: {line['reason']}",
                  flush=True)  # fmt: skip
        elif line["event"] == "switch":
            committed = Result(line["result"]) is Result.COMMITTED
            print(f"== switch at step {line['step']}: {line['from']} -> {line['to']}: "
                  f"{line['result']}, pause {line['pause_seconds']:.3f} s, prepared in "
                  f"{line['prepare_seconds']:.2f} s, {line['network_bytes'] / 1e6:.1f} MB "
                  f"moved{'' if committed else ': ' + line['reason']}", flush=True)  # fmt: skip
        elif line["event"] == "unmade":
            print(f"== switch to {line['to']} at step {line['step']} not made: "
                  f"{line['reason']}", flush=True)  # fmt: skip
        elif line["event"] == "checkpoint" and line["result"] == "failed":
            print(f"== checkpoint at step {line['step']} to {line['path']} failed: "
                  f"{line['reason']}", flush=True)  # fmt: skip
        elif line["event"] == "checkpoint":
            print(f"== checkpoint at step {line['step']} to {line['path']} in "
                  f"{line['seconds']:.2f} s", flush=True)  # fmt: skip

    return emit
