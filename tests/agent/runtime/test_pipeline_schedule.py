"""The pipeline schedules' orders and programs, without torch or processes: every micro-batch's
forward before its backward, backwards in the order of the forwards under both schedules, the
activations a stage holds at its peak, the bubble, and that no program deadlocks, neither with
sends posted without waiting (gloo; a simulation of the stages' clocks) nor with sends that wait
for their receive, each rank's messages in the order posted (NCCL; a simulation of the groups)."""

from __future__ import annotations

import itertools

import pytest

from liveshard_agent.runtime.pipeline_schedule import (
    Action,
    Message,
    Pass,
    PipelineSchedule,
    bubble_fraction,
    peak_held,
    stage_order,
    stage_program,
)

GPIPE, ONE_F_ONE_B = PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B
SHAPES = list(itertools.product(range(1, 6), range(1, 10)))  # (pp, micro)


def simulate(schedule: PipelineSchedule, pp: int, micro: int, forward: float, backward: float):
    """Each stage's passes on a clock, a forward taking `forward`, a backward `backward`, a
    transfer nothing: a pass starts when its stage is free and its input has arrived. Returns
    each stage's busy time and the step's end; a deadlock raises."""
    orders = [stage_order(schedule, pp, i, micro) for i in range(pp)]
    done: dict[tuple[int, Pass, int], float] = {}
    free, busy, position = [0.0] * pp, [0.0] * pp, [0] * pp
    while any(position[i] < len(orders[i]) for i in range(pp)):
        moved = False
        for i in range(pp):
            while position[i] < len(orders[i]):
                kind, m = orders[i][position[i]]
                needs = (
                    [(i - 1, Pass.FORWARD, m)] if kind is Pass.FORWARD and i > 0
                    else [(i + 1, Pass.BACKWARD, m)] if kind is Pass.BACKWARD and i < pp - 1
                    else []
                ) + ([(i, Pass.FORWARD, m)] if kind is Pass.BACKWARD else [])  # fmt: skip
                if any(n not in done for n in needs):
                    break  # a blocking receive: the stage waits
                cost = forward if kind is Pass.FORWARD else backward
                start = max([free[i], *(done[n] for n in needs)])
                free[i] = done[(i, kind, m)] = start + cost
                busy[i] += cost
                position[i] += 1
                moved = True
        if not moved:
            raise AssertionError(f"{schedule} pp={pp} micro={micro} deadlocks at {position}")
    return busy, max(free)


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
@pytest.mark.parametrize(("pp", "micro"), SHAPES)
def test_each_stage_runs_every_pass_once_backwards_in_forward_order(
    schedule: PipelineSchedule, pp: int, micro: int
) -> None:
    for stage in range(pp):
        order = stage_order(schedule, pp, stage, micro)
        assert sorted(order, key=lambda p: (p[0].value, p[1])) == sorted(
            [(k, m) for k in Pass for m in range(micro)], key=lambda p: (p[0].value, p[1])
        )
        for m in range(micro):
            assert order.index((Pass.FORWARD, m)) < order.index((Pass.BACKWARD, m))
        # The same order of gradient accumulation as GPipe's: bit-identical gradients.
        assert [m for k, m in order if k is Pass.BACKWARD] == list(range(micro))


@pytest.mark.parametrize(("pp", "micro"), SHAPES)
def test_1f1b_holds_at_most_pp_minus_stage_micro_batches_gpipe_all(pp: int, micro: int) -> None:
    for stage in range(pp):
        assert peak_held(stage_order(GPIPE, pp, stage, micro)) == micro
        assert peak_held(stage_order(ONE_F_ONE_B, pp, stage, micro)) == min(pp - stage, micro)


def test_1f1b_warms_up_alternates_then_drains() -> None:
    # Stage 1 of 4 with 8 micro-batches: 2 warm-up forwards, 6 forward-backward pairs, 2 drains.
    order = stage_order(ONE_F_ONE_B, 4, 1, 8)
    assert "".join(k.value[0].upper() for k, _ in order) == "FF" + "FB" * 6 + "BB"
    assert [m for _, m in order[:4]] == [0, 1, 2, 0]


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
@pytest.mark.parametrize(("pp", "micro"), SHAPES)
def test_no_deadlock_and_the_bubble_is_the_same_for_both(
    schedule: PipelineSchedule, pp: int, micro: int
) -> None:
    busy, end = simulate(schedule, pp, micro, forward=1.0, backward=2.0)
    for stage_busy in busy:
        assert 1 - stage_busy / end == pytest.approx(bubble_fraction(pp, micro))


def rendezvous(programs: list[list[Action]]) -> bool:
    """Whether the stages' programs run to their end when a message completes only while its
    counterpart is in the group its peer has posted last (a group completes when all of its
    messages have), as NCCL runs them; False on a deadlock."""
    position, matched = [0] * len(programs), set()
    while True:
        moved = False
        for i, program in enumerate(programs):
            if position[i] == len(program):
                continue
            for message in program[position[i]].messages:
                j = message.peer
                other = Message(not message.send, message.carries, message.micro, i)
                if position[j] < len(programs[j]) and other in programs[j][position[j]].messages:
                    matched |= {(i, message), (j, other)}
            if all((i, message) in matched for message in program[position[i]].messages):
                position[i] += 1
                moved = True
        if all(p == len(program) for p, program in zip(position, programs, strict=True)):
            return True
        if not moved:
            return False


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
@pytest.mark.parametrize(("pp", "micro"), SHAPES)
def test_programs_match_messages_and_run_to_the_end_on_nccl(
    schedule: PipelineSchedule, pp: int, micro: int
) -> None:
    programs = [stage_program(schedule, pp, i, micro) for i in range(pp)]
    for i, program in enumerate(programs):
        assert [a.run for a in program if a.run is not None] == stage_order(schedule, pp, i, micro)
        for action in program:
            assert sum(not m.send for m in action.messages) <= 1  # one receive to wait for
            assert len({m.peer for m in action.messages}) <= 1  # paired only with the same peer
            for m in action.messages:
                other = Message(not m.send, m.carries, m.micro, i)
                assert sum(other in s.messages for s in programs[m.peer]) == 1
    assert rendezvous(programs)


def test_1f1b_needs_its_sends_paired_with_the_next_receive_on_nccl() -> None:
    # Each message posted on its own: stage 0 sends micro-batch 1's activation while stage 1
    # sends micro-batch 0's gradient, each waiting for a receive the other posts next.
    programs = [
        [Action((m,), None) for a in stage_program(ONE_F_ONE_B, 2, i, 4) for m in a.messages]
        for i in range(2)
    ]
    assert not rendezvous(programs)
    assert rendezvous([stage_program(ONE_F_ONE_B, 2, i, 4) for i in range(2)])


def test_a_stage_outside_the_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stage=2 must be in \[0, pp=2\)"):
        stage_order(ONE_F_ONE_B, 2, 2, 4)
