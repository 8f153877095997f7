"""A reconfiguration in flight, decided from what its members' agents say: commit it when every
member of the new world that is still there trains in its epoch (the agents act on one decision
recorded in the change's store, so once one trains in it all will, and a member that died after
the decision is recovered from on the next pass), abort it when none did and one gave up, a
member vanished or its deadline passed (then retry with backoff, or restore from a checkpoint
when the same recovery would abort again), and otherwise wait, sending Prepare to whoever has not
taken it yet. An abort is recorded only if no agent answers that the epoch is already in effect
(`decision.overtaken`). A member whose store died before it read the decision is undecided
(`Pending.UNDECIDED`): the operator tells it the decision the others read, commit when any member
trains in the epoch, else abort once no member is still switching (one may have read a commit and
not said so yet). Some members committed and others aborted cannot happen; should it, the job
fails (`SplitReconfiguration`). Pure, like `decide`.
"""

from __future__ import annotations

from dataclasses import replace

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.job import Result

from . import rebalance
from .actions import AbortOn, CommitOn, DeletePod, Event, EventType, ReleaseMember
from .decision import Draft, prepares
from .messages import cause_of, result_of
from .observation import Observation, trains_in
from .publish import Failure, Summary
from .world import InFlight

_MAX_BACKOFF = 120.0


def backoff(attempts: int) -> float:
    """Seconds before retrying after `attempts` aborted reconfigurations in a row."""
    return min(5.0 * 2.0 ** max(attempts - 1, 0), _MAX_BACKOFF)


def _pending_in(agent: pb.AgentStatus, epoch: int, *states: int) -> bool:
    """Whether the agent has `epoch` pending in one of `states`."""
    pending = agent.pending
    return agent.HasField("pending") and pending.epoch == epoch and pending.state in states


def _gave_up(agent: pb.AgentStatus, epoch: int) -> bool:
    """Whether the agent aborted `epoch`'s switch or failed to prepare it."""
    switch = agent.last_switch
    aborted = (
        agent.HasField("last_switch")
        and switch.epoch == epoch
        and result_of(switch) is Result.ABORTED
    )
    return aborted or _pending_in(agent, epoch, pb.Pending.FAILED)


Verdict = tuple[bool, bool, bool, bool]


def verdict(agent: pb.AgentStatus, epoch: int) -> Verdict:
    """What of an agent's status `progress` acts on in `epoch`'s reconfiguration: whether it
    trains in the epoch, has given its account of the switch, gave up or could not read the
    decision, and whether its world broke or it failed."""
    return (
        trains_in(agent, epoch),
        agent.last_switch.epoch == epoch,
        _gave_up(agent, epoch) or _pending_in(agent, epoch, pb.Pending.UNDECIDED),
        agent.phase in (pb.AgentStatus.BROKEN, pb.AgentStatus.FAILED),
    )


_SETTLED = (True, True, False, False)  # switched, and said how


def watched_member(plan: InFlight, seen: Observation) -> tuple[str, Verdict] | None:
    """The member of `plan`'s new world whose verdict the loop follows until its next pass, and
    its verdict as seen: the first one seen that has not settled. The members act on one
    decision, so when its verdict changes, the others' change with it."""
    for member in plan.new.members:
        pod = seen.pods.get(member)
        if pod is None or pod.agent is None or pod.gone:
            continue
        found = verdict(pod.agent, plan.epoch)
        if found != _SETTLED:
            return member, found
    return None


def _refusing(plan: InFlight, agents: dict[str, pb.AgentStatus]) -> list[str]:
    """The members whose world broke before `plan`'s epoch, when it is neither a recovery nor a
    rebuild: they take only one of those (the plan was begun before their break was seen, e.g.
    right after the commit of a world that broke at once), so it can never be made. (One broken
    in the plan's epoch committed it.)"""
    old = plan.old
    if (
        old is None
        or plan.lost
        or (old.degrees, old.members) == (plan.new.degrees, plan.new.members)
    ):
        return []
    return [
        m for m, a in agents.items() if a.phase == pb.AgentStatus.BROKEN and a.epoch < plan.epoch
    ]  # fmt: skip


def progress(draft: Draft, plan: InFlight) -> None:
    """The next step of `plan`, in flight."""
    pods = draft.seen.pods
    union = plan.union()
    agents: dict[str, pb.AgentStatus] = {}
    for member in union:
        pod = pods.get(member)
        if pod is not None and pod.agent is not None:
            agents[member] = pod.agent
    trained = [m for m in plan.new.members if m in agents and trains_in(agents[m], plan.epoch)]
    aborted = [m for m, a in agents.items() if _gave_up(a, plan.epoch)]
    refusing = _refusing(plan, agents)
    vanished = [m for m in union if m not in pods or pods[m].gone]
    overdue = draft.now - plan.started > draft.job.spec.deadlines.total + 60
    there = [m for m in plan.new.members if m not in vanished]
    undecided = [m for m, a in agents.items() if _pending_in(a, plan.epoch, pb.Pending.UNDECIDED)]
    # A member still switching may have read a commit and not said so yet.
    switching = [
        m for m, a in agents.items()
        if m not in vanished and _pending_in(a, plan.epoch, pb.Pending.PREPARED)
    ]  # fmt: skip
    # A member says it trains in the new epoch a moment before its account of the switch (the
    # pause, the bytes) is in its status: the record waits for one account, unless there is no
    # switch (a first world: a start, a restore) or a member is gone (the survivors' account
    # then waits for the dead epoch's collectives).
    accounts = [agents[m].last_switch for m in trained if agents[m].last_switch.epoch == plan.epoch]
    if trained and not aborted and len(trained) == len(there):
        if accounts or plan.old is None or vanished or overdue:
            _commit(draft, plan, agents, accounts[0] if accounts else None)
        else:
            draft.message = f"epoch {plan.epoch}: every member switched; waiting for an account"
    elif trained and aborted:
        _split(draft, plan, trained, aborted)
    elif trained:
        draft.after += [CommitOn(m, plan.epoch) for m in undecided]
        told = f"; telling {', '.join(undecided)} it committed" if undecided else ""
        draft.message = (
            f"epoch {plan.epoch}: {len(trained)}/{len(there)} members switched; "
            f"{len(vanished)} vanished after the decision{told}"
        )
    elif undecided and switching and not overdue:
        draft.message = (
            f"epoch {plan.epoch}: {', '.join(undecided)} could not read the decision; waiting "
            f"for {', '.join(switching)} to end the switch"
        )
    elif aborted or refusing or vanished or overdue or undecided:
        why = (f"aborted by {', '.join(aborted)}" if aborted else
               f"lost {', '.join(vanished)}" if vanished else
               f"the world of {', '.join(refusing)} broke: only a recovery can follow" if refusing
               else
               f"no member read the decision ({', '.join(undecided)} could not)" if undecided
               else "deadline passed")  # fmt: skip
        detail = next((agents[m].last_switch.reason or agents[m].pending.reason
                       for m in aborted), "")  # fmt: skip
        why = f"{why}: {detail}" if detail else why
        _abort(draft, plan, why, agents)
        causes = {cause_of(agents[m].last_switch) for m in aborted}
        # the same recovery would abort again
        if any(c is not None and c.permanent for c in causes):
            what = f"recovery from the loss of {', '.join(plan.lost)}" if plan.lost else "rebuild"
            restore = f"the {what} {why}"
            draft.record = replace(draft.record, restore=restore)
    else:
        draft.after += prepares(draft.job, draft.seen, plan)
        draft.message = (
            f"epoch {plan.epoch}: {len(trained)}/{len(plan.new.members)} members switched"
        )


def _commit(
    draft: Draft, plan: InFlight, agents: dict[str, pb.AgentStatus],
    account: pb.SwitchSummary | None,
) -> None:  # fmt: skip
    """Record `plan` committed, with a member's `account` of its switch (None: none to give,
    or none given before a member was lost)."""
    last = Summary.of(
        plan, Result.COMMITTED,
        (account.reason if account else "") or f"epoch {plan.epoch}: committed",
        pause_seconds=round(account.pause_seconds, 4) if account and plan.old else 0.0,
        bytes_moved=int(account.network_bytes) if account else 0,
    )  # fmt: skip
    # A checkpoint asked for but not saved is asked again: the joiners never had it.
    saved = max((agents[m].last_checkpoint.number for m in plan.new.members if m in agents),
                default=0)  # fmt: skip
    draft.record = replace(draft.record, world=plan.new, in_flight=None, attempts=0,
                           retry_after=0.0,
                           checkpoint_asked=min(draft.record.checkpoint_asked, saved))  # fmt: skip
    draft.last = last
    rebalance.committed(draft, plan)
    draft.after.append(Event(EventType.NORMAL, "Reconfigured",
                             f"epoch {plan.epoch} committed: {last.old or 'nothing'} -> "
                             f"{last.new} ({plan.reason}); pause {last.pause_seconds} s, "
                             f"{last.bytes_moved} bytes moved"))  # fmt: skip
    members = set(plan.new.members)
    draft.label(members)
    left = [m for m in (plan.old.members if plan.old else ()) if m not in members]
    wanted = rebalance.replicas(draft)  # a pack's members are released as in a scale-down
    kept = {draft.seen.pod_name(m) for m in members}  # a pod goes once all its members left
    for member in left:
        pod = draft.seen.pods.get(member)
        draft.after.append(ReleaseMember(member))
        if pod is None or pod.leaving or pod.pod_name in kept:
            continue
        if len(draft.seen.live()) > wanted:
            draft.after.append(DeletePod(pod.pod_name))


def _abort(draft: Draft, plan: InFlight, why: str, agents: dict[str, pb.AgentStatus]) -> None:
    draft.unaborted = draft.record
    for member, agent in agents.items():
        if agent.HasField("pending") and agent.pending.epoch == plan.epoch:
            draft.before.append(AbortOn(member, plan.epoch))
    attempts = draft.record.attempts + 1
    draft.record = replace(draft.record, in_flight=None, attempts=attempts,
                           retry_after=draft.now + backoff(attempts))  # fmt: skip
    draft.last = Summary.of(plan, Result.ABORTED, why)
    draft.after.append(Event(EventType.WARNING, "ReconfigurationAborted",
                             f"epoch {plan.epoch} aborted ({plan.reason}): {why}; the job keeps "
                             f"its layout, retry in {backoff(attempts):.0f} s"))  # fmt: skip


def _split(draft: Draft, plan: InFlight, trained: list[str], failed: list[str]) -> None:
    """Some members committed and others aborted: the switch protocol forbids it (every member
    acts on the one recorded decision, or is undecided until told), so this guards against a
    breach. No world is whole; only a checkpoint can bring the job back."""
    message = (
        f"epoch {plan.epoch}: members {trained} committed but {failed} aborted; restore the job "
        "from a checkpoint"
    )
    draft.failure = Failure("SplitReconfiguration", message)
    draft.after.append(Event(EventType.WARNING, "SplitReconfiguration", message))
