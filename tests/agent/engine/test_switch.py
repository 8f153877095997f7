"""Multi-process tests of the switch: up to 6 worker processes on gloo, CPU.

Each transition starts every old member from the seeded state, switches, and checks on every new
member that every box equals the seeded expectation bit for bit (the vote already compared the
layout-independent checksums before and after).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from liveshard_e2e.workers import Died, Pool
from tests.agent.engine.helpers import run_switch
from tests.helpers import names

# tp=2 and tp=3 both divide heads, kv_heads, ffn and vocab.
THREE_WAY = dict(name="three", vocab=96, hidden=24, layers=3, heads=12, kv_heads=6, head_dim=2,
                 ffn=48)  # fmt: skip

TRANSITIONS = {
    "dp grow 2->4": ("tiny", ("dp=2,zero=1", names(2)), ("dp=4,zero=1", names(4))),
    "dp shrink 4->2": ("tiny", ("dp=4,zero=1", names(4)), ("dp=2,zero=1", names(2))),
    "tp 1->2 fused": ("tiny", ("dp=2", names(2)), ("tp=2,dp=2", names(4))),
    "tp 2->3 non power of two": (THREE_WAY, ("tp=2", names(2)), ("tp=3,zero=1", names(3))),
    "pp even -> uneven": ("tiny", ("pp=2,dp=2,zero=1", names(4)),
                          ("pp=2,pp_layers=1:3,dp=2,zero=1", names(4))),
    "pp 2 -> 1 with a member removed": ("tiny", ("pp=2,dp=2", names(4)), ("dp=3", names(3))),
    "ep 2 -> 1": ("tiny-moe", ("dp=4,ep=2,zero=1", names(4)), ("dp=2,ep=1,zero=1", names(2))),
    "ep 1 -> 2 with tp": ("tiny-moe", ("tp=2,dp=2", names(4)), ("dp=4,ep=2,zero=3", names(4))),
    "zero 0 -> 3": ("tiny", ("dp=3", names(3)), ("dp=3,zero=3", names(3))),
    "zero 3 -> 1": ("tiny", ("dp=3,zero=3", names(3)), ("dp=2,zero=1", names(2))),
    "replace a specific member": ("tiny", ("dp=4,zero=1", names(4)),
                                  ("dp=4,zero=1", ["m0", "m1", "m4", "m3"])),
    "1 -> N": ("tiny", ("dp=1", names(1)), ("dp=2,tp=2,zero=1", names(4))),
    "N -> 1": ("tiny-moe", ("dp=4,ep=2,zero=1", names(4)), ("dp=1", names(1, start=5))),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_transition_commits_with_exact_state(pool: Pool, name: str) -> None:
    model, old, new = TRANSITIONS[name]
    # A small budget forces several rounds and chunked pieces.
    results = run_switch(pool, model, old, new, budget=16 << 10)
    for member, r in results.items():
        assert r["committed"], f"{member}: {r['reason']}"
        assert r["cause"] is None
        assert r["wrong_boxes"] == [], f"{member} holds boxes that differ from the seed"
        assert r["peak_staging"] <= r["budget"]
        assert (r["state_bytes"] > 0) == (member in new[1]), member
        # The caller's old state object is released on commit, so it cannot be used by mistake.
        assert r["old_released"] == (member in old[1]), member
        assert r["record"]["result"] == "committed"
        assert r["record"]["sent_bytes"] == r["sent"]
    assert sum(r["sent"] for r in results.values()) == sum(r["received"] for r in results.values())


def _assert_all_aborted_intact(results: dict[str, Any]) -> None:
    for member, r in results.items():
        if isinstance(r, Died):
            continue
        assert not r["committed"], member
        assert "epoch" in r["reason"], r["reason"]
        assert r["record"]["cause"] == r["cause"]
        assert r["old_intact"], f"{member}: old state changed by an aborted switch"
        assert not r["old_released"], member
        assert r["wrong_boxes"] == [] or r["state_bytes"] == 0, member


def test_vote_no_aborts_everywhere_then_next_switch_commits(pool: Pool) -> None:
    old, new = ("dp=2,zero=1", names(2)), ("tp=2,dp=2,zero=1", names(4))
    results = run_switch(pool, "tiny", old, new, faults={"m3": ("vote_no", 0, 0)})
    _assert_all_aborted_intact(results)
    assert all(r["cause"] == "vote_no" for r in results.values()), results
    assert "injected vote no" in results["m3"]["reason"]
    assert all("1 member(s) voted no" in r["reason"] for m, r in results.items() if m != "m3")
    # The old state is still usable: the same change, retried, commits.
    retried = run_switch(pool, "tiny", old, new)
    assert all(r["committed"] and not r["wrong_boxes"] for r in retried.values())


def test_killed_peer_aborts_survivors_then_they_recover_without_it(pool: Pool) -> None:
    # m3 leaves and m4 joins, so there is network traffic (rounds) for m2 to die in.
    old, new = ("dp=4", names(4)), ("tp=2,dp=2,zero=1", ["m0", "m1", "m2", "m4"])
    deadline = 6.0
    results = run_switch(pool, "tiny", old, new, faults={"m2": ("exit", 0, 0)},
                         budget=16 << 10, timeouts=(5, deadline, 30))  # fmt: skip
    assert isinstance(results["m2"], Died)
    survivors = {m: r for m, r in results.items() if m != "m2"}
    _assert_all_aborted_intact(survivors)
    # Its peers see it fail and name it, and abort the union at once, so that the members
    # waiting on them fail too (naming them) instead of waiting for the deadline.
    assert {r["cause"] for r in survivors.values()} <= {"peer_failed", "vote_incomplete"}
    assert any(r["cause"] == "peer_failed" and "member m2" in r["reason"]
               for r in survivors.values()), survivors  # fmt: skip
    for r in survivors.values():
        assert r["seconds"] < deadline + 5, r
    # Right after, the survivors switch to a layout without m2, from the copies they hold.
    recovery = run_switch(pool, "tiny", old, ("dp=3,zero=1", ["m0", "m1", "m3"]), lost=["m2"],
                          keep=True)  # fmt: skip
    assert set(recovery) == {"m0", "m1", "m3"}
    assert all(r["committed"] and not r["wrong_boxes"] for r in recovery.values()), recovery


def test_stalled_peer_aborts_at_the_deadline(pool: Pool) -> None:
    old, new = ("dp=2,zero=1", names(2)), ("dp=3,zero=1", names(3))
    deadline = 3.0
    results = run_switch(pool, "tiny", old, new, faults={"m1": ("stall", 0, deadline + 2)},
                         timeouts=(2, deadline, 30))  # fmt: skip
    _assert_all_aborted_intact(results)
    others = [r for m, r in results.items() if m != "m1"]
    # Members waiting on m1 pass the deadline naming it; the others' vote cannot complete.
    assert {r["cause"] for r in others} <= {"deadline_passed", "vote_incomplete"}, others
    assert any(r["cause"] == "deadline_passed" and "member m1" in r["reason"] for r in others)
    for r in others:
        assert r["seconds"] < deadline + 4, r
    # Right after, the old state is usable for a switch that commits.
    retried = run_switch(pool, "tiny", old, new)
    assert all(r["committed"] for r in retried.values())


def test_plan_mismatch_is_caught_before_any_byte_moves(pool: Pool) -> None:
    old = ("dp=4", names(4))
    # m3 believes the new layout is tp=2,dp=2; the others believe dp=4 with zero=1.
    port = pool.run({0: ("host", {})})[0]
    tasks = {}
    for i, m in enumerate(names(4)):
        new = ("tp=2,dp=2", names(4)) if m == "m3" else ("dp=4,zero=1", names(4))
        tasks[i] = ("switch", dict(member=m, port=port, epoch=1000, model="tiny", old=old,
                                   new=new, timeouts=(5, 10, 10)))  # fmt: skip
    results = pool.run(tasks)
    for r in results.values():
        assert r.get("mismatch"), r
        assert r["cause"] == "plan_mismatch"
        assert r["intact"]
    assert all("m3" in r["reason"] for w, r in results.items() if w != 3)


def test_repeated_switches_do_not_grow_threads_or_memory(pool: Pool) -> None:
    members = names(4)
    cycle = [("dp=4,zero=1", members), ("tp=2,dp=2,zero=3", members),
             ("pp=2,dp=2", members), ("dp=4,zero=1", members)]  # fmt: skip
    usage: list[dict[int, dict[str, int]]] = []
    for round_trip in range(2):
        for step, (old, new) in enumerate(itertools.pairwise(cycle)):
            keep = round_trip > 0 or step > 0
            results = run_switch(pool, "tiny", old, new, keep=keep)
            assert all(r["committed"] and not r["wrong_boxes"] for r in results.values())
        usage.append(pool.run({w: ("usage", {}) for w in range(4)}))
    first, second = usage
    for w in range(4):
        assert second[w]["threads"] <= first[w]["threads"], (first[w], second[w])
        assert second[w]["python_threads"] <= first[w]["python_threads"]
        assert second[w]["rss"] - first[w]["rss"] < 32 << 20, (first[w], second[w])


def test_new_world_is_built_while_the_old_world_trains(pool: Pool) -> None:
    old, new = ("dp=2,zero=1", names(2)), ("tp=2,dp=2,zero=1", names(4))
    results = run_switch(pool, "tiny", old, new, train=True)
    assert all(r["committed"] and not r["wrong_boxes"] for r in results.values())
    # The old members kept stepping (all-reducing) while the union and new groups were built.
    assert all(results[m]["steps_while_preparing"] > 0 for m in old[1])


def test_unverified_switch_moves_the_same_bytes(pool: Pool) -> None:
    model, old, new = TRANSITIONS["pp 2 -> 1 with a member removed"]
    verified = run_switch(pool, model, old, new, budget=16 << 10)
    unverified = run_switch(pool, model, old, new, budget=16 << 10, verify=False)
    assert all(r["committed"] and not r["wrong_boxes"] for r in unverified.values()), unverified
    for member, r in unverified.items():
        for key in ("sent", "received", "rounds", "state_bytes"):
            assert r[key] == verified[member][key], (member, key)
        assert (r["record"]["verified"], verified[member]["record"]["verified"]) == (False, True)
