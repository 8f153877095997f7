"""The layout policy: the layout to use for a number of members, the spares it leaves, and why.

`choose_layout` is a pure function (the operator calls it too):
1. Candidates: every tp (the fixed one, or each divisor of heads, KV heads, vocab and FFN up to
   `tp_max`, and of a pod's members when members come in pods: `tp_divides`), every pp up to
   `pp_max` and the layer count (balanced, uneven when pp does not divide the layers), every ep
   (the fixed one, or 1 for dense models and each divisor of the experts for MoE), every ZeRO
   stage asked for, and the dp values that fit the members: the largest one, and with a global
   batch every dp that divides it into dp x micro-batches.
2. Feasible: the spec's divisibility (`Layout.check`), ep dividing dp, the global batch, and the
   memory per device (`model.estimate`) within the device memory.
3. Best: among the feasible layouts that use the most members (a job is given members to use
   them: fewer only when no feasible layout takes them all), the smallest step time
   (`model.estimate`). From a current layout, among the (at most four fastest) of those within
   `tolerance` of the best step time, the one that moves the fewest bytes (the best member
   assignment, `assign`); its spares are the survivors whose state is cheapest to leave.
When nothing is feasible the error names the constraint that rejected the most promising
candidates (e.g. the memory a device would need against its memory).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass

from ..assign.assign import Problem
from ..errors import InvalidInput
from ..layout.layout import Degrees, Layout
from ..vps.spec import ModelSpec
from .model import Estimate, Hardware, StageLoad, Workload, estimate, stage_loads

_COMPARED = 4  # layouts whose bytes to move are compared, at most


@dataclass(frozen=True)
class Constraints:
    """What the job fixes or bounds; None leaves an axis free."""

    tp: int | None = None
    tp_max: int = 8  # a node's devices: tp stays inside one
    tp_divides: int = 0  # the members of a pod (0: no pods): a free tp divides it, staying inside
    pp: int | None = None
    pp_max: int | None = None
    ep: int | None = None
    zero: int = 1
    mirror: bool = False  # mirror ZeRO shards (`Layout.mirror`) wherever a layout can
    global_batch: int | None = None  # sequences per step; None: 8 micro-batches per member
    micro_batch: int = 1
    seq_len: int = 4096
    tolerance: float = 0.02  # step times this close to the best count as equal (with a current)


@dataclass(frozen=True)
class LayoutChoice:
    """The chosen layout for a member count, with the spares it leaves and why."""

    degrees: Degrees
    members: int  # members available
    spares: tuple[int, ...]  # member numbers left out (see `choose_layout`)
    estimate: Estimate
    bytes_to_move: int | None  # from the current layout, with the best assignment
    members_to: tuple[int | None, ...] | None  # per new rank, the member taking it
    candidates: int  # feasible layouts compared
    why: tuple[str, ...]

    def describe(self) -> str:
        d = self.degrees
        stages = ":".join(map(str, d.pp_layers or ()))
        return f"dp={d.dp},tp={d.tp},pp={d.pp},ep={d.ep},zero={d.zero},pp_layers={stages}"


def choose_layout(
    spec: ModelSpec,
    members: int,
    constraints: Constraints | None = None,
    hardware: Hardware | None = None,
    current: Layout | None = None,
) -> LayoutChoice:
    """The layout for `members` members (module docstring).

    Members are numbered as in `members`: with a `current` layout its members are 0..W-1 by
    rank, the rest are joiners numbered after; without, 0..members-1 and the spares are the
    highest-numbered (no member holds state yet)."""
    if type(members) is not int or members < 1:
        raise InvalidInput(f"members={members!r} must be an integer >= 1")
    c = constraints or Constraints()
    hardware = hardware or Hardware()
    if c.zero not in (0, 1, 3):
        raise InvalidInput(f"zero={c.zero!r} must be one of (0, 1, 3)")
    if c.micro_batch < 1 or c.seq_len < 1:
        raise InvalidInput("micro_batch and seq_len must be >= 1")
    if c.global_batch is not None and c.global_batch < 1:
        raise InvalidInput(f"global_batch={c.global_batch!r} must be >= 1")
    batch = c.global_batch or 8 * members * c.micro_batch
    work = Workload(batch, c.micro_batch, c.seq_len)
    rejected: Counter[str] = Counter()
    closest: dict[str, tuple[float, str]] = {}
    feasible: list[tuple[float, Degrees, Layout, Estimate]] = []
    loads: dict[tuple[int, int, int, tuple[int, ...] | None], list[StageLoad]] = {}
    for degrees in _candidates(spec, members, c):
        if degrees.dp % degrees.ep:
            rejected["ep must divide dp"] += 1
            continue
        layout = _layout(spec, degrees)
        reason = _infeasible(spec, layout, c)
        if reason is not None:
            rejected[reason] += 1
            continue
        key = (degrees.tp, degrees.pp, degrees.ep, degrees.pp_layers)
        if key not in loads:
            loads[key] = stage_loads(spec, layout)
        est = estimate(spec, layout, work, hardware, loads[key])
        if est.memory > hardware.memory:
            rejected["memory"] += 1
            shortfall = est.memory / hardware.memory
            if "memory" not in closest or shortfall < closest["memory"][0]:
                closest["memory"] = (shortfall, f"{_text(degrees)} needs {est.memory} bytes")
            continue
        feasible.append((est.step_seconds, degrees, layout, est))
    if not feasible:
        raise InvalidInput(_no_layout(spec, members, c, hardware, rejected, closest))
    most = max(f[1].world_size for f in feasible)
    fewer = sum(f[1].world_size < most for f in feasible)
    feasible = [f for f in feasible if f[1].world_size == most]
    feasible.sort(key=lambda f: (f[0], -f[1].world_size, f[1].pp, f[1].tp, f[1].ep))
    best_time = feasible[0][0]
    why = [
        f"{len(feasible)} feasible layouts use {most} of {members} members of "
        f"{spec.config.name} ({fewer} more use fewer); rejected: {dict(rejected) or 'none'}",
    ]
    if current is None:
        step, degrees, layout, est = feasible[0]
        spares = tuple(range(degrees.world_size, members))
        why.append(f"smallest predicted step time: {step:.4g} s ({_parts(est)})")
        if spares:
            why.append(f"{len(spares)} members left as spares: no feasible layout uses all")
        return LayoutChoice(degrees, members, spares, est, None, None, len(feasible), tuple(why))
    # The assignment is exact but costs seconds at thousands of ranks: the fastest few only.
    near = [f for f in feasible if f[0] <= best_time * (1 + c.tolerance)][:_COMPARED]
    survivors = list(range(min(current.world_size, members)))
    choices = []
    for step, degrees, layout, est in near:
        joiners = max(degrees.world_size - len(survivors), 0)
        assignment = Problem(spec, current, layout).best(survivors, joiners)
        choices.append((assignment.network_bytes, step, degrees, est, assignment))
    moved, step, degrees, est, assignment = min(
        choices, key=lambda x: (x[0], x[1], x[2].pp, x[2].tp)
    )
    joined = sum(m is None for m in assignment.members_to)
    unneeded_joiners = range(current.world_size + joined, max(members, current.world_size))
    spares = (*assignment.spares, *unneeded_joiners)
    why.append(
        f"{len(near)} layouts within {c.tolerance:.0%} of the best step time "
        f"({best_time:.4g} s); the one moving the fewest bytes from {current.describe()}: "
        f"{moved} bytes, step {step:.4g} s ({_parts(est)})"
    )
    if assignment.spares:
        why.append(
            f"spares {list(assignment.spares)}: the survivors whose state is cheapest to leave "
            "(best assignment)"
        )
    return LayoutChoice(
        degrees, members, spares, est, moved, assignment.members_to, len(feasible), tuple(why)
    )


def _text(degrees: Degrees) -> str:
    return f"tp={degrees.tp},pp={degrees.pp},dp={degrees.dp},ep={degrees.ep},zero={degrees.zero}"


def _parts(est: Estimate) -> str:
    return ", ".join(f"{k} {v:.3g} s" for k, v in est.step_parts.items() if v)


def _layout(spec: ModelSpec, degrees: Degrees) -> Layout:
    # Layout() checks only what needs no spec; `check` below names the spec's constraints.
    return Layout(
        degrees.dp, degrees.tp, degrees.pp, degrees.ep, degrees.zero, degrees.pp_layers or (),
        _numbered(degrees.world_size), degrees.mirror,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _numbered(size: int) -> tuple[str, ...]:
    """Placeholder members "0".."size-1": a choice costs hundreds of candidate layouts, each
    of the world's size, on every operator pass."""
    return tuple(str(i) for i in range(size))


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _candidates(spec: ModelSpec, members: int, c: Constraints) -> list[Degrees]:
    cfg = spec.config
    layers = cfg.layers
    tps = [c.tp] if c.tp is not None else _divisors(cfg.heads, c.tp_max)
    tps = [tp for tp in tps if not c.tp_divides or c.tp_divides % tp == 0]
    pp_max = min(c.pp_max or layers, layers)
    free_eps = _divisors(cfg.experts, members) if cfg.experts else [1]
    eps = [c.ep] if c.ep is not None else free_eps
    out = []
    pps = [c.pp] if c.pp is not None else list(range(1, pp_max + 1))
    for tp in tps:
        for pp in pps:
            if tp * pp > members:
                break
            pp_layers = tuple(layers // pp + (1 if s < layers % pp else 0) for s in range(pp))
            most = members // (tp * pp)
            if c.global_batch is None:
                dps = [most]
            else:
                per = c.global_batch // c.micro_batch if c.global_batch % c.micro_batch == 0 else 0
                dps = [d for d in _divisors(per, most)] if per else []
                dps = dps or [most]  # rejected below, naming the batch
            for dp in dps:
                for ep in eps:
                    out.append(Degrees(dp, tp, pp, ep, c.zero, pp_layers).mirrored(c.mirror))
    return out


def _infeasible(spec: ModelSpec, layout: Layout, c: Constraints) -> str | None:
    """The name of the first constraint `layout` breaks, or None."""
    try:
        layout.check(spec)
    except InvalidInput as err:
        # "layout: tp=3 must divide heads=4 of m" -> "tp must divide heads of m"
        return re.sub(r"=[^ ,]+", "", str(err).removeprefix("layout: "))
    if c.global_batch is not None and c.global_batch % (layout.dp * c.micro_batch):
        return "global batch"
    return None


def _no_layout(
    spec: ModelSpec,
    members: int,
    c: Constraints,
    hw: Hardware,
    rejected: Counter[str],
    closest: dict[str, tuple[float, str]],
) -> str:
    head = f"no layout of at most {members} members fits {spec.config.name}"
    if not rejected:  # the smallest tp x pp already needs more members
        tp, pp = c.tp or 1, c.pp or 1
        return f"{head}: tp={tp} x pp={pp} needs {tp * pp} members; add members or lower --tp"
    if "memory" in closest:
        _, text = closest["memory"]
        return (
            f"{head}: memory per device: the smallest need is {text} of {hw.memory} bytes of "
            "device memory; add members, raise --zero or --pp-max, or lower the batch"
        )
    if "global batch" in rejected:
        return (
            f"{head}: global batch {c.global_batch} must divide into dp x micro-batch "
            f"({c.micro_batch}) for some dp the members allow"
        )
    name, _ = rejected.most_common(1)[0]
    return f"{head}: {name} (every candidate broke it: {dict(rejected)})"
