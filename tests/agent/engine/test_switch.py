"""Multi-process tests of the switch: up to 6 worker processes on gloo, CPU.

Each transition starts every old member from the seeded state, switches, and checks on every new
member that every box equals the seeded expectation bit for bit (the vote already compared the
layout-independent checksums before and after: the tests verify the whole state unless they say
otherwise). Both memory modes run: resident (the default) and bounded.
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
                         budget=16 << 10, deadlines=(5, deadline, 30))  # fmt: skip
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


def test_a_switch_takes_bytes_inside_pods_and_its_members_agree_on_them(pool: Pool) -> None:
    # Two pods of two, tp inside pods: dp=4 takes each member's other tp half from its pod.
    old, new = ("tp=2,dp=2,zero=1", names(4)), ("dp=4,zero=1", names(4))
    pods = {"m0": "a", "m1": "a", "m2": "b", "m3": "b"}
    results = run_switch(pool, "tiny", old, new, pods=pods)
    assert all(r["committed"] and not r["wrong_boxes"] for r in results.values()), results
    # The pods are part of the plan: a member told other pods refuses to move a byte.
    other = {"m3": {"pods": {**pods, "m3": "c"}}}
    results = run_switch(pool, "tiny", old, new, pods=pods, only=other)
    assert all(r["mismatch"] and r["intact"] for r in results.values()), results


def test_stalled_peer_aborts_at_the_deadline(pool: Pool) -> None:
    old, new = ("dp=2,zero=1", names(2)), ("dp=3,zero=1", names(3))
    deadline = 3.0
    results = run_switch(pool, "tiny", old, new, faults={"m1": ("stall", 0, deadline + 2)},
                         deadlines=(2, deadline, 30))  # fmt: skip
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
                                   new=new, deadlines=(5, 10, 10)))  # fmt: skip
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


BOUNDED = ["dp grow 2->4", "dp shrink 4->2", "tp 1->2 fused", "tp 2->3 non power of two",
           "pp 2 -> 1 with a member removed", "ep 1 -> 2 with tp", "zero 3 -> 1", "1 -> N",
           "N -> 1"]  # fmt: skip


@pytest.mark.parametrize("name", BOUNDED)
def test_bounded_mode_commits_within_the_budget_plus_growth(pool: Pool, name: str) -> None:
    model, old, new = TRANSITIONS[name]
    budget = 16 << 10
    results = run_switch(pool, model, old, new, budget=budget, memory="bounded")
    for member, r in results.items():
        assert r["committed"], f"{member}: {r['reason']}"
        assert r["wrong_boxes"] == [], f"{member} holds boxes that differ from the seed"
        assert r["old_released"] == (member in old[1]), member
        record = r["record"]
        assert record["memory_mode"] == "bounded"
        growth = max(0, r["state_bytes"] - r["old_bytes"])
        # Device memory above the old state never exceeded the budget plus the member's growth.
        assert record["peak_extra_bytes"] <= budget + growth, (member, record)
        assert r["peak_staging"] <= budget
    # Old boxes were given back as the transfer went, wherever one was not passed on whole.
    assert any(r["record"]["released_bytes"] > 0 for r in results.values())


@pytest.mark.parametrize(
    "fault", [("vote_no", 0, 0), ("corrupt", 0, 0)], ids=["vote no", "wrong byte"]
)
def test_bounded_abort_restores_the_old_state_bit_for_bit(
    pool: Pool, fault: tuple[str, int, float]
) -> None:
    # m1 leaves and m4, m5 join: old boxes are given back during the transfer, then restored.
    old, new = ("dp=2,zero=1", names(2)), ("tp=2,dp=2,zero=1", ["m0", "m2", "m4", "m5"])
    faults, only = {}, {}
    if fault[0] == "corrupt":
        only = {"m4": {"corrupt": True}}
    else:
        faults = {"m5": fault}
    results = run_switch(pool, "tiny", old, new, budget=16 << 10, memory="bounded",
                         verify="moved", faults=faults, only=only)  # fmt: skip
    _assert_all_aborted_intact(results)
    for member in old[1]:
        r = results[member]
        # Its old storage had been given back, and came back from the host copy: every box
        # equals the seed bit for bit (`_assert_all_aborted_intact`) in the same object.
        assert r["record"]["released_bytes"] > 0, (member, r["record"])
        assert r["record"]["seconds"]["restore"] >= 0
    expected = "checksum_mismatch" if fault[0] == "corrupt" else "vote_no"
    assert {r["cause"] for r in results.values()} == {expected}, results
    # The restored state switches again, and commits.
    retried = run_switch(pool, "tiny", old, new, budget=16 << 10, memory="bounded",
                         verify="moved")  # fmt: skip
    assert all(r["committed"] and not r["wrong_boxes"] for r in retried.values()), retried


@pytest.mark.parametrize("verify", ["moved", "state"])
def test_a_wrong_byte_received_aborts_everywhere(pool: Pool, verify: str) -> None:
    # dp=1 after the change: every box has one holder, which the whole-state check counts (it
    # counts each box at its lowest-ranked holder only; the moved-bytes check sees every copy).
    model, old, new = TRANSITIONS["tp 2->3 non power of two"]
    results = run_switch(pool, model, old, new, budget=16 << 10, verify=verify,
                         only={"m2": {"corrupt": True}})  # fmt: skip
    assert results["m2"]["corrupted"], "the test transport changed nothing"
    _assert_all_aborted_intact(results)
    assert {r["cause"] for r in results.values()} == {"checksum_mismatch"}, results
    if verify == "moved":  # the vote names the member whose bytes arrived wrong
        assert all("['m2']" in r["reason"] for r in results.values()), results


def test_a_wrong_byte_at_a_replica_is_caught_by_the_moved_check(pool: Pool) -> None:
    model, old, new = TRANSITIONS["tp 1->2 fused"]  # m3 is a dp replica of m1 afterwards
    results = run_switch(pool, model, old, new, budget=16 << 10, verify="moved",
                         only={"m3": {"corrupt": True}})  # fmt: skip
    assert results["m3"]["corrupted"], "the test transport changed nothing"
    _assert_all_aborted_intact(results)
    assert all("['m3']" in r["reason"] for r in results.values()), results


@pytest.mark.parametrize("name", ["dp grow 2->4", "tp 2->3 non power of two", "N -> 1"])
def test_moved_verification_commits(pool: Pool, name: str) -> None:
    model, old, new = TRANSITIONS[name]
    results = run_switch(pool, model, old, new, budget=16 << 10, verify=True)
    for member, r in results.items():
        assert r["committed"], f"{member}: {r['reason']}"
        assert r["wrong_boxes"] == []
        assert (r["record"]["verification"], r["record"]["verified"]) == ("moved", True)


def test_members_that_disagree_about_the_budget_or_verification_are_refused(pool: Pool) -> None:
    old, new = ("dp=2,zero=1", names(2)), ("dp=3,zero=1", names(3))
    for differ in ({"budget": 8 << 10}, {"verify": "none"}):
        results = run_switch(pool, "tiny", old, new, budget=16 << 10, verify="moved",
                             deadlines=(5, 10, 10), only={"m2": differ})  # fmt: skip
        for member, r in results.items():
            assert r.get("mismatch"), r
            assert r["cause"] == "plan_mismatch"
            assert r["intact"] == (member in old[1]), member  # a joining member holds nothing
        assert all("m2" in r["reason"] for m, r in results.items() if m != "m2")
