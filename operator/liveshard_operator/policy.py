"""Which layout a job runs with a given number of members, and which member takes which rank.

The choice belongs to the pure core's layout policy (`liveshard_core.policy.choose_layout`) and
member assignment (`liveshard_core.assign`); this module states the job's constraints and its
devices to them. CPU jobs are costed with what a collective costs between local processes on gloo
(milliseconds, whatever its size), GPU jobs with the policy's defaults (an H100 node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from liveshard_core.assign.assign import placed_members
from liveshard_core.assign.nodes import balanced, spread
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
    return Constraints(
        tp=p.tp, pp=p.pp, pp_max=p.pp_max, ep=p.ep, zero=p.zero, mirror=job.snapshots,
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
) -> list[str]:
    """The new layout's members in rank order: the survivors placed to move the fewest bytes
    (the core's exact assignment), the joiners on the ranks left (mirrored: those on the least
    crowded nodes first), spread so that the fewest mirror pairs share a node."""
    if degrees.mirror:
        joiners = balanced(joiners, node_of, survivors)
    members = placed_members(spec, old, degrees, survivors, iter(joiners).__next__)
    return spread(degrees, members, survivors, node_of)


def pick(degrees: Degrees, ready: list[str], used: int, node_of: Mapping[str, str]) -> list[str]:
    """A first layout's `used` members (no state to keep) out of the `ready` pods, in rank
    order: mirrored, those on the least crowded nodes first, spread so that the fewest mirror
    pairs share a node."""
    if degrees.mirror:
        ready = balanced(ready, node_of)
    return spread(degrees, ready[:used], (), node_of)
