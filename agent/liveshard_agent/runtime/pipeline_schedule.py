"""The order in which a pipeline stage runs its micro-batches' forwards and backwards.

Two schedules, the `pipeline_schedule` training setting (`PipelineSchedule`):
- GPipe: every stage runs all its forwards, then all its backwards. A stage holds the saved
  activations of every micro-batch at once.
- 1F1B (PipeDream-flush, Megatron's non-interleaved schedule): stage i runs
  min(pp - i - 1, micro) warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. A stage holds at most pp - i micro-batches' activations.

Both run the backwards in the order of the forwards, so every parameter's gradient sums its
micro-batches in the same order under both: they give bit-identical gradients, hence losses. With
uniform forward and backward times both idle (pp - 1) / (micro + pp - 1) of a step on each stage
(`bubble_fraction`): 1F1B bounds memory, not the bubble.

A stage's program (`stage_program`) adds its messages to the order: a pass receives its input
(an activation from the previous stage, a gradient from the next) and sends its output. A pass's
send is posted together with the next pass's receive when both go to the same peer (Megatron's
send-forward-receive-backward and send-backward-receive-forward): NCCL runs a rank's messages in
the order they were posted and a send waits for its receive, so two stages that each sent before
receiving from the other would wait on each other; posted as one group call they cannot. Gloo
posts sends without waiting and needs no pairing, and gets the same program.

Pure: no torch. `pipeline.train_step` runs the program; this module must not communicate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PipelineSchedule(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


def stage_order(
    schedule: PipelineSchedule, pp: int, stage: int, micro: int
) -> list[tuple[Pass, int]]:
    """The passes stage `stage` (0-based) of `pp` runs over micro-batches 0 .. micro - 1, in
    order: each micro-batch's forward once, then its backward once."""
    if not 0 <= stage < pp or micro < 1:
        raise ValueError(f"stage={stage} must be in [0, pp={pp}) and micro={micro} >= 1")
    forwards = [(Pass.FORWARD, m) for m in range(micro)]
    backwards = [(Pass.BACKWARD, m) for m in range(micro)]
    if schedule is PipelineSchedule.GPIPE:
        return forwards + backwards
    warmup = min(pp - stage - 1, micro)
    order = forwards[:warmup]
    for m in range(micro - warmup):
        order += [forwards[warmup + m], backwards[m]]
    return order + backwards[micro - warmup :]


def peak_held(order: list[tuple[Pass, int]]) -> int:
    """The most micro-batches whose forward ran and backward did not yet, at once: the saved
    activations a stage holds at its peak, in micro-batches."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind is Pass.FORWARD else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(pp: int, micro: int) -> float:
    """The share of a step each stage idles, with uniform forward and backward times: the same
    for GPipe and 1F1B."""
    return (pp - 1) / (micro + pp - 1)


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a stage: micro-batch `micro`'s activation (`carries`
    FORWARD) or gradient (BACKWARD), sent to or received from stage `peer`."""

    send: bool
    carries: Pass
    micro: int
    peer: int


@dataclass(frozen=True)
class Action:
    """Post `messages` as one group and wait for its receive, then run the pass `run` (None:
    a send posted on its own, nothing to run)."""

    messages: tuple[Message, ...]
    run: tuple[Pass, int] | None


def stage_program(schedule: PipelineSchedule, pp: int, stage: int, micro: int) -> list[Action]:
    """Stage `stage`'s passes in `stage_order`, with the messages each needs posted before it."""
    actions: list[Action] = []
    pending: Message | None = None  # the previous pass's output, not yet posted
    for kind, m in stage_order(schedule, pp, stage, micro):
        forward = kind is Pass.FORWARD
        source = stage - 1 if forward else stage + 1
        receive = Message(False, kind, m, source) if 0 <= source < pp else None
        if pending is not None and receive is not None and pending.peer == receive.peer:
            actions.append(Action((pending, receive), (kind, m)))
        else:
            if pending is not None:
                actions.append(Action((pending,), None))
            actions.append(Action((receive,) if receive is not None else (), (kind, m)))
        target = stage + 1 if forward else stage - 1
        pending = Message(True, kind, m, target) if 0 <= target < pp else None
    if pending is not None:
        actions.append(Action((pending,), None))
    return actions
