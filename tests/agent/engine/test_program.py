"""Single-process tests of a member's program: the messages both ends of a pair derive, their
buffers against the budget, and what the bounded mode learns from it."""

from __future__ import annotations

from collections import defaultdict

import pytest

from liveshard_agent.engine.program import PACK_BELOW, Program, build_program, locate
from liveshard_agent.engine.state import region_boxes, state_bytes_of
from liveshard_core.layout.layout import Layout, parse_degrees
from liveshard_core.plan.plan import build_plan
from liveshard_core.plan.schedule import build_schedule
from liveshard_core.vps.presets import preset
from liveshard_core.vps.spec import ModelSpec
from tests.helpers import names

CHANGES = [
    ("tiny", ("dp=2,zero=1", names(2)), ("tp=2,dp=2,zero=1", names(4))),
    ("tiny", ("pp=2,dp=2", names(4)), ("dp=3", names(3))),
    ("tiny-moe", ("tp=2,dp=2", names(4)), ("dp=4,ep=2,zero=3", names(4))),
    ("tiny", ("dp=3,zero=3", names(3)), ("dp=2,zero=1", names(2))),
]
BUDGET = 16 << 10


def programs(
    model: str, old: tuple[str, list[str]], new: tuple[str, list[str]], bounded: bool = False
) -> tuple[ModelSpec, Layout, Layout, dict[str, Program]]:
    spec = preset(model)
    old_layout = parse_degrees(old[0]).layout(spec, old[1])
    new_layout = parse_degrees(new[0]).layout(spec, new[1])
    plan = build_plan(spec, old_layout, new_layout)
    schedule = build_schedule(plan, BUDGET)
    out = {}
    for member in plan.members:
        held = {}
        if member in old_layout.ranks:
            held = region_boxes(spec, old_layout, old_layout.rank_of(member))
        needed = {}
        if member in new_layout.ranks:
            needed = region_boxes(spec, new_layout, new_layout.rank_of(member))
        out[member] = build_program(
            schedule, plan.slot_of(member), old_boxes=held, new_boxes=needed,
            sends_need_buffers=bounded,
        )  # fmt: skip
    return spec, old_layout, new_layout, out


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: f"{c[1][0]} -> {c[2][0]}")
def test_both_ends_of_every_message_agree(change: tuple) -> None:
    _, _, _, by_member = programs(*change)
    slots = {p.slot: m for m, p in by_member.items()}
    sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for program in by_member.values():
        for r, round_ in enumerate(program.rounds):
            for m in round_.messages:
                pieces = [(p.ref, p.box, p.offset) for p in m.parts]
                entry = (r, m.tag, m.nbytes, m.packed, pieces)
                if m.send:
                    sent[(program.slot, m.peer)].append(entry)
                else:
                    received[(m.peer, program.slot)].append(entry)
    assert set(sent) == set(received)
    for direction, messages in sent.items():
        assert sorted(messages) == sorted(received[direction]), [slots[s] for s in direction]
        tags = [entry[1] for entry in messages]
        assert sorted(tags) == list(range(len(tags)))  # numbered per direction, once each


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: f"{c[1][0]} -> {c[2][0]}")
@pytest.mark.parametrize("bounded", [False, True], ids=["resident", "bounded"])
def test_rounds_keep_their_buffers_within_the_budget(change: tuple, bounded: bool) -> None:
    _, _, _, by_member = programs(*change, bounded=bounded)
    for member, program in by_member.items():
        for round_ in program.rounds:
            assert round_.buffer_bytes <= BUDGET, member
            for m in round_.messages:
                # Small pieces travel packed; a lone piece is one at least PACK_BELOW bytes.
                assert m.packed or len(m.parts) == 1
                assert all(p.nbytes < PACK_BELOW for p in m.parts) or not m.packed
                assert m.nbytes == sum(p.nbytes for p in m.parts)
                # Packed pieces are laid out back to back, largest element size first.
                offsets = [p.offset for p in m.parts]
                assert offsets == sorted(offsets) and offsets[0] == 0
                assert all(p.offset % p.itemsize == 0 for p in m.parts)
        assert sum(len(r.messages) for r in program.rounds) >= program.active_rounds


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: f"{c[1][0]} -> {c[2][0]}")
def test_programs_move_exactly_the_plan(change: tuple) -> None:
    spec, old, new, by_member = programs(*change)
    plan = build_plan(spec, old, new)
    sends, receives = plan.slot_bytes
    for member, program in by_member.items():
        assert program.sent_bytes == sends.get(program.slot, 0)
        assert program.received_bytes == receives.get(program.slot, 0)
        # What a member keeps and what it receives make up its new state exactly.
        kept = sum(c.nbytes for c in program.local)
        needed = state_bytes_of(spec, new, new.rank_of(member)) if member in new.ranks else 0
        assert kept + program.received_bytes == needed, member


def test_boxes_held_whole_under_both_layouts_are_passed_on() -> None:
    # zero 1 -> zero 1 with the same dp: every member keeps every box as it is.
    _, _, _, by_member = programs("tiny", ("dp=2,zero=1", names(2)), ("dp=2,zero=1", names(2)))
    for program in by_member.values():
        assert all(c.whole for c in program.local)
        assert all(ob.kept and ob.last_round is None for ob in program.old_boxes)
        assert all(nb.kept and nb.first_round is None for nb in program.new_boxes)
        assert all(not r.messages for r in program.rounds)


def test_old_boxes_are_read_until_their_last_round_and_new_boxes_filled_from_their_first() -> None:
    _, _, _, by_member = programs(*CHANGES[0])
    for program in by_member.values():
        last = {(ob.ref, ob.index): ob.last_round for ob in program.old_boxes}
        first = {(nb.ref, nb.index): nb.first_round for nb in program.new_boxes}
        for r, round_ in enumerate(program.rounds):
            for m in round_.messages:
                for p in m.parts:
                    if m.send:
                        assert last[(p.ref, p.at.index)] >= r
                    else:
                        assert first[(p.ref, p.at.index)] <= r


def test_locate_finds_the_box_and_says_whether_the_piece_is_contiguous() -> None:
    boxes = [((0, 4), (0, 8)), ((4, 8), (0, 8))]
    rows = locate(boxes, ((5, 7), (0, 8)))
    assert (rows.index, rows.contiguous, rows.whole, rows.rows) == (1, True, False, (1, 2))
    assert rows.slices == (slice(1, 3), slice(0, 8))
    columns = locate(boxes, ((0, 4), (2, 6)))
    assert (columns.index, columns.contiguous, columns.whole, columns.rows) == (
        0,
        False,
        False,
        None,
    )
    one_row = locate(boxes, ((2, 3), (2, 6)))  # part of a single row: contiguous
    assert one_row.contiguous
    whole = locate(boxes, ((4, 8), (0, 8)))
    assert whole.whole and whole.contiguous
    with pytest.raises(KeyError, match="no box"):
        locate(boxes, ((3, 5), (0, 8)))
