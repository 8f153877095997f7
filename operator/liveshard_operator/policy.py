"""Which layout a job runs with a given number of members, and which member takes which rank.

The choice belongs to the pure core's layout policy (`liveshard_core.policy.choose_layout`) and
member assignment (`liveshard_core.assign`); this module states the job's constraints and its
devices to them. CPU jobs are costed with what a collective costs between local processes on gloo
(milliseconds, whatever its size), GPU jobs with the policy's defaults (an H100 node).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from liveshard_core.assign import nodes as assign_nodes
from liveshard_core.assign.assign import placed_members, pod_grouped_members, pod_slots
from liveshard_core.assign.nodes import balanced, pairs_on_one_node, spread
from liveshard_core.layout.layout import Degrees, Layout
from liveshard_core.policy.layout import Constraints, choose_layout
from liveshard_core.policy.model import Hardware
from liveshard_core.vps.spec import ModelSpec

from .spec import JobSpec

# gloo between processes of one machine: ~2 GB/s, 2-5 ms per collective (measured here).
CPU = Hardware(
    memory=64 << 30, flops=50e9, efficiency=0.5, tp_bandwidth=2e9, network_bandwidth=2e9,
    latency=2e-3,
)  # fmt: skip


@dataclass(frozen=True)
class Choice:
    degrees: Degrees
    used: int  # members the layout uses; the rest stand by as hot spares
    why: str


def constraints(job: JobSpec) -> Constraints:
    p, t = job.parallelism, job.training
    # A pod of several members keeps a tensor-parallel group inside it (its devices' links).
    tp_divides = job.members_per_pod if job.members_per_pod > 1 else 0
    return Constraints(
        tp=p.tp, tp_divides=tp_divides, pp=p.pp, pp_max=p.pp_max, ep=p.ep, zero=p.zero,
        mirror=job.snapshots,
        global_batch=t.global_batch, micro_batch=t.micro_batch, seq_len=t.seq_len,
    )  # fmt: skip


def hardware(job: JobSpec) -> Hardware:
    """The devices and links the job's layouts are costed on."""
    return CPU if job.device == "cpu" else Hardware()


def choose(spec: ModelSpec, job: JobSpec, members: int) -> Choice:
    """The layout for at most `members` members (InvalidInput naming the constraint when none
    fits)."""
    choice = choose_layout(spec, members, constraints(job), hardware(job))
    return Choice(choice.degrees, choice.degrees.world_size, "; ".join(choice.why))


def assign(
    spec: ModelSpec,
    old: Layout,
    degrees: Degrees,
    survivors: list[str],
    joiners: list[str],
    node_of: Mapping[str, str],
    pod_of: Mapping[str, str] | None = None,
) -> list[str]:
    """The new layout's members in rank order: the survivors placed to move the fewest bytes
    (the core's exact assignment), the joiners on the ranks left (mirrored: those on the least
    crowded nodes first), spread so that the fewest mirror pairs share a node. Members in pods
    of several (`pod_of`) fill each tensor-parallel group from one pod: the groups are slots of
    a pod's members, placed to keep the most bytes (`grouped_members`)."""
    members = pod_grouped_members(spec, old, degrees, survivors + joiners, pod_of)
    if members is None:
        if degrees.mirror:
            joiners = balanced(joiners, node_of, survivors)
        members = placed_members(spec, old, degrees, survivors, iter(joiners).__next__)
    return spread(degrees, members, survivors, node_of)


def respread(
    degrees: Degrees, members: Sequence[str], node_of: Mapping[str, str], in_pods: bool = False
) -> tuple[list[str], int, int] | None:
    """A world's members in rank order with members exchanged so that fewer mirror pairs share
    a node (`assign.nodes.respread`), with the pairs on one node before and after; None when no
    exchange parts any, or when tensor-parallel groups are pods' (`in_pods`: an exchange of two
    members would split them). Remembered per world and nodes: a pass finds it again at once
    (the search takes up to half a second at 1024 members, and a world whose pairs no exchange
    parts is seen by every pass)."""
    if in_pods and degrees.tp > 1:
        return None
    found = _respread(degrees, tuple(members), tuple(node_of.get(m, "") for m in members))
    return None if found is None else (list(found[0]), found[1], found[2])


@lru_cache(maxsize=16)
def _respread(
    degrees: Degrees, members: tuple[str, ...], nodes: tuple[str, ...]
) -> tuple[tuple[str, ...], int, int] | None:
    node_of = {m: n for m, n in zip(members, nodes, strict=True) if n}
    shared = pairs_on_one_node(degrees, members, node_of)
    if not shared:
        return None
    out = assign_nodes.respread(degrees, members, node_of)
    after = pairs_on_one_node(degrees, out, node_of)
    return (tuple(out), shared, after) if after < shared else None


def pick(
    degrees: Degrees,
    ready: list[str],
    used: int,
    node_of: Mapping[str, str],
    pod_of: Mapping[str, str] | None = None,
) -> list[str]:
    """A first layout's `used` members (no state to keep) out of the `ready` pods, in rank
    order: mirrored, those on the least crowded nodes first, spread so that the fewest mirror
    pairs share a node; in pods of several (`pod_of`), tp at a time from one pod."""
    slots = pod_slots(ready, degrees.tp, None, pod_of)
    if slots is not None and len(slots) * degrees.tp >= used:
        ready = [m for slot in slots for m in slot]
    elif degrees.mirror:
        ready = balanced(ready, node_of)
    return spread(degrees, ready[:used], (), node_of)
