"""Live pipeline rebalancing, the operator's side of DynMo's loop: from the costs the members
measure to a reconfiguration that moves layers between the pipeline stages (`rebalance`), runs on
fewer stages and releases the members of the others (`pack`), or on more stages again, on new pods
(`grow`). What calls for which is the core's `policy.rebalance.propose`; this module feeds it the
job's world, costs and limits, and keeps what it needs across passes (`world.Rebalancing`, in
`status.rebalance` and `status.released`).

- `consider`: when a world trains with nothing else to do (`decide` calls it with no loss, no
  eviction, no scale change, no checkpoint to ask for and no backoff) and `spec.rebalance.enabled`,
  a full window of costs (`spec.rebalance.windowSteps` steps measured in this world: the members
  restart their window at every switch) may call for a switch to another partition of the same
  degrees, with as many or (`spec.rebalance.pack`, pp not fixed) fewer stages, or, once packed,
  more again: up to the pp the policy chooses for spec.replicas, taking back at most the members
  packing released. The predicted pause is the dry run's (`plan.predict`) over the job's links
  (`policy.hardware`: 2 GB/s between CPU processes, 25 GB/s per GPU). A grow that needs more
  members than stand by is recorded; `replicas` then counts its pods, which are created and
  pre-warm as in a scale-up, and the grow begins once they are ready (while its proposal still
  holds).
- `keeps`: a world is kept whatever the policy would choose for its member count when it differs
  from that choice only in its partition (a rebalanced world is never switched back to the even
  default), or when the job runs packed (fewer members than spec.replicas, until a grow or a
  change of spec.replicas).
- `replicas`: the members the job runs on: spec.replicas less what packing released, plus what a
  grow waits for. Packing ends when spec.replicas changes or packing is turned off; the job then
  scales to spec.replicas as usual.
- `committed`: a committed rebalance, pack or grow adds the partition it left to
  `status.rebalance.left` (a return to one needs twice the threshold); a pack's members that left
  go to `status.released`, a grow takes as many back.

Pure, like `decide`; it begins nothing itself: `consider` returns the layout to switch to and
why, and `decide` begins the reconfiguration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from liveshard_core.errors import InvalidInput
from liveshard_core.layout.layout import Degrees, Layout
from liveshard_core.plan.predict import Links, predicted_pause
from liveshard_core.policy.model import state_bytes_per_layer
from liveshard_core.policy.rebalance import GROW, PACK, REBALANCE, Proposal, StepCosts, propose

from . import policy
from .actions import Event, EventType
from .decision import Draft
from .publish import measured
from .spec import JobSpec
from .world import InFlight, World

KINDS = (REBALANCE, PACK, GROW)  # a reconfiguration's reason starts with its kind and a colon
_EVENTS = {REBALANCE: "Rebalance", PACK: "Pack", GROW: "Grow"}


@dataclass(frozen=True)
class Move:
    """A switch rebalancing calls for: the layout to switch to, and why."""

    layout: Layout
    reason: str


def replicas(draft: Draft) -> int:
    """The members the job runs on (module docstring); forgets the packing that spec.replicas or
    spec.rebalance no longer stands for."""
    spec, state = draft.job.spec, draft.record.rebalance
    settings = spec.rebalance
    if (state.packed or state.grow) and (
        state.replicas != spec.replicas or not (settings.enabled and settings.pack)
    ):
        state = replace(state, released=(), replicas=0, grow=())
        draft.record = replace(draft.record, rebalance=state)
    world = draft.record.world
    waited = 0
    if state.grow and world is not None:
        waited = max(_size(world.degrees, state.grow) - len(world.members), 0)
    return spec.replicas - len(state.released) + waited


def keeps(draft: Draft, old: Layout, chosen: Layout) -> bool:
    """Whether the world in `old` stays though the policy chose `chosen` for its member count
    (module docstring)."""
    state = draft.record.rebalance
    if state.packed or state.grow:
        return True
    even = replace(chosen.degrees, pp_layers=None)
    return set(old.members) == set(chosen.members) and replace(old.degrees, pp_layers=None) == even


def consider(draft: Draft, world: World, standby: list[str]) -> Move | None:
    """The switch a full window of costs calls for, if any (module docstring); a grow short of
    ready pods is recorded instead, and waits for them."""
    spec, model = draft.job.spec, draft.job.model
    settings = spec.rebalance
    costs = measured(draft.seen, world)
    if not settings.enabled or costs is None or costs.steps < settings.window_steps:
        return None
    if len(costs.layer_seconds) != model.config.layers:
        draft.message = (f"rebalance: the members measured {len(costs.layer_seconds)} layers, "
                         f"the model has {model.config.layers}")  # fmt: skip
        return None
    old = world.layout(model)
    state = draft.record.rebalance
    # A fixed pp is the user's; a pod of several members is released whole, never a member.
    packs = settings.pack and spec.parallelism.pp is None and spec.members_per_pod == 1
    joiners = [f"joiner-{i}" for i in range(spec.max_replicas)]  # names for predicting pauses
    try:
        proposal = propose(
            replace(settings, pack=packs),
            StepCosts(tuple(costs.layer_seconds), costs.first_seconds, costs.last_seconds),
            old.pp_layers, spec.training.micro_batches(old.dp),
            lambda pp_layers: _pause(spec, draft, old, _layout(draft, old, pp_layers, joiners)),
            max_stages=_max_stages(draft, old) if packs and state.packed else None,
            left=state.left,
            memory=state_bytes_per_layer(model, old), memory_cap=_memory_cap(spec),
        )  # fmt: skip
    except InvalidInput as err:
        draft.message = f"rebalance: {err}"
        return None
    if state.grow and (proposal is None or proposal.kind != GROW):
        state = replace(state, grow=())  # the costs no longer call for it: its pods go
        draft.record = replace(draft.record, rebalance=state)
    if proposal is None:
        return None
    need = _size(old.degrees, proposal.pp_layers) - len(old.members)
    reason = _reason(proposal, old, need)
    if need > len(standby):  # a grow short of ready pods
        short = need - len(standby)
        if state.grow != proposal.pp_layers:
            draft.record = replace(draft.record, rebalance=replace(state, grow=proposal.pp_layers))
            draft.after.append(Event(EventType.NORMAL, _EVENTS[GROW], f"{reason}: creating "
                                     f"{short} pod(s)"))  # fmt: skip
        draft.message = f"{reason}: waiting for {short} pod(s) to be ready"
        return None
    layout = _layout(draft, old, proposal.pp_layers, standby[: max(need, 0)])
    draft.after.append(Event(EventType.NORMAL, _EVENTS[proposal.kind], (
        f"{reason}: pp_layers {_text(old.pp_layers)} -> {_text(proposal.pp_layers)}, "
        f"predicted pause {proposal.pause_seconds:.3g} s"
    )))  # fmt: skip
    return Move(layout, reason)


def committed(draft: Draft, plan: InFlight) -> None:
    """What `plan`, committed, leaves rebalancing to remember (module docstring); a first world
    (a start, a restore) ends any packing."""
    state = draft.record.rebalance
    kind = plan.reason.split(":", 1)[0]
    if plan.old is None:
        state = replace(state, released=(), replicas=0, grow=())
    elif kind in KINDS:
        state = state.leaving(plan.old.degrees.pp_layers or ())
        if kind == PACK:
            gone = [m for m in plan.old.members if m not in plan.new.members]
            released = (*state.released, *gone)
            state = replace(state, released=released, replicas=draft.job.spec.replicas)
        elif kind == GROW:
            gained = len(plan.new.members) - len(plan.old.members)
            released = state.released[: max(len(state.released) - gained, 0)]
            state = replace(state, released=released, replicas=state.replicas if released else 0,
                            grow=())  # fmt: skip
    else:  # a recovery or an eviction: a grow is proposed again from the new world's costs
        state = replace(state, grow=())
    draft.record = replace(draft.record, rebalance=state)


def _size(degrees: Degrees, pp_layers: tuple[int, ...]) -> int:
    return degrees.dp * degrees.tp * len(pp_layers)


def _layout(draft: Draft, old: Layout, pp_layers: tuple[int, ...], joiners: list[str]) -> Layout:
    """The layout of `old`'s degrees on `pp_layers`: its members placed to move the fewest bytes,
    `joiners` on the ranks a grow adds."""
    degrees = old.degrees.repartitioned(pp_layers)
    members = policy.assign(draft.job.model, old, degrees, list(old.members), joiners,
                            draft.seen.nodes(), draft.seen.pod_of())  # fmt: skip
    return degrees.layout(draft.job.model, members)


def _pause(spec: JobSpec, draft: Draft, old: Layout, new: Layout) -> float:
    """The dry run's pause of the switch from `old` to `new`, over the job's links."""
    hardware = policy.hardware(spec)
    links = None
    if spec.members_per_pod > 1:  # a pod's members share its devices' links
        links = Links(draft.seen.pod_of(), hardware.tp_bandwidth)  # the pods a change is told
    return predicted_pause(draft.job.model, old, new, spec.budget_bytes,
                           hardware.network_bandwidth, hardware.latency, links)  # fmt: skip


def _max_stages(draft: Draft, old: Layout) -> int:
    """The most stages a packed job may grow back to: the pp the policy chooses for
    spec.replicas members, and no more than today's members and those packing released hold at
    today's dp and tp."""
    spec = draft.job.spec
    try:
        pp = policy.choose(draft.job.model, spec, spec.replicas).degrees.pp
    except InvalidInput:
        return old.pp
    members = len(old.members) + len(draft.record.rebalance.released)
    return max(min(pp, members // (old.dp * old.tp)), old.pp)


def _memory_cap(spec: JobSpec) -> int | None:
    """Bytes of training state a device may hold: the pod's memory limit for CPU jobs (None
    without one), the device's memory as the policy costs it for GPU jobs."""
    return spec.memory_limit() if spec.device == "cpu" else policy.hardware(spec).memory


def _reason(proposal: Proposal, old: Layout, need: int) -> str:
    """The reconfiguration's reason: its kind, then what it is predicted to win."""
    stages = len(proposal.pp_layers)
    what = {
        REBALANCE: "",
        PACK: f"{old.pp} -> {stages} stages, releasing {-need} member(s); ",
        GROW: f"{old.pp} -> {stages} stages on {need} new member(s); ",
    }[proposal.kind]
    return (
        f"{proposal.kind}: {what}imbalance {proposal.imbalance_before:.2f} -> "
        f"{proposal.imbalance_after:.2f}, step {proposal.step_seconds_before:.3g} s -> "
        f"{proposal.step_seconds_after:.3g} s predicted"
    )


def _text(pp_layers: tuple[int, ...]) -> str:
    return ":".join(map(str, pp_layers))
