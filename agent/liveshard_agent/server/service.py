"""The Agent service's semantics: what each call asks of the member, and when it is refused.

Each mutating call is checked in full before anything is enqueued: its fields (`requests`), then,
under one lock, the agent's state as the status board shows it, including commands accepted and
not yet obeyed (claims). A request that passes becomes one runtime command in the inbox and a
claim on the board, so the next call (and GetStatus) already sees it. Repeating an accepted
request is answered OK and enqueues nothing, so an operator that restarted can replay its last
step. Handlers return at once (the member takes commands at its next step boundary), except Abort,
which waits for the member's answer so the caller learns whether the switch got there first
(unless it asks only to queue the drop: `queue_only`).

Raised errors become status codes through `errors.status_of`. This module must not touch the
member: everything reaches it through the inbox, on the loop's thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.errors import InvalidInput
from liveshard_core.job import Deadlines, Result
from liveshard_core.layout.layout import Layout

from ..engine.record import ContextLogger, context_logger
from ..engine.world import StoreAddress
from ..runtime.loop import CheckpointAt, Command, Drop, Prepare, Start, Stop, SwitchAt
from ..runtime.member import recovers, superseding
from . import requests
from .certs import ServingCertificate
from .errors import NotNow, Overtaken, Refused
from .inbox import CommandInbox, Ticket
from .status import Claim, ClaimKind, PendingState, Phase, Snapshot, StatusBoard

log = logging.getLogger(__name__)

WATCH_LIMIT = 16  # concurrent WatchStatus streams; each holds one of the server's threads
_WATCH_POLL = 1.0  # seconds between checks that a watcher is still there


class Context(Protocol):
    """What the service uses of a call's grpc.ServicerContext."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float | None: ...


class Store(Protocol):
    @property
    def port(self) -> int: ...


class AgentService:
    def __init__(
        self,
        *,
        job: requests.Job,
        job_name: str,
        pod_ip: str,
        board: StatusBoard,
        inbox: CommandInbox,
        layouts: dict[int, Layout],
        use_deadlines: Callable[[Deadlines], None],
        host_store: Callable[[StoreAddress, float], Store],
        serving: ServingCertificate | None = None,
    ) -> None:
        """`serving`: the API's serving certificate, when it is served over TLS."""
        self.job, self.job_name, self.pod_ip = job, job_name, pod_ip
        self.serving = serving
        self.board, self.inbox = board, inbox
        self.layouts = layouts  # the layout each accepted epoch leads to (shared with reporting)
        self.use_deadlines = use_deadlines  # runs on the loop's thread as a Prepare is taken
        self.host_store = host_store
        self.stores: dict[int, Store] = {}  # by epoch: the one in effect and the newest asked
        self._store_maker = ThreadPoolExecutor(1, thread_name_prefix="store")
        self._spare = self._make_store()
        self.accepted: dict[int, pb.PrepareRequest] = {}  # every epoch this agent was asked for
        self.checkpoints: dict[int, pb.CheckpointRequest] = {}
        self.drops: dict[int, Ticket] = {}
        self.released = threading.Event()
        self.discarded = threading.Event()  # released with its state dropped: the job is gone
        self._lock = threading.Lock()
        self._watchers = 0

    @property
    def log(self) -> ContextLogger:
        epoch = self.board.get().observed.epoch
        return context_logger(log, job=self.job_name, epoch=epoch, member=self.job.member)

    # ---- status ----

    def get_status(self, request: pb.GetStatusRequest, __: Context) -> pb.AgentStatus:
        return self.board.get().to_proto(layout=not request.omit_layout)

    def get_pod_status(self, request: pb.GetStatusRequest, context: Context) -> pb.PodStatus:
        """A lone agent's pod holds only it."""
        return pb.PodStatus(members=[self.get_status(request, context)])

    def watch_status(self, _: pb.WatchStatusRequest, context: Context) -> Iterator[pb.AgentStatus]:
        with self._lock:
            if self._watchers >= WATCH_LIMIT:
                raise NotNow(f"{WATCH_LIMIT} watchers already follow this agent; try later")
            self._watchers += 1
        try:
            version, snapshot = self.board.wait_newer(-1, 0)
            yield snapshot.to_proto()
            while context.is_active() and not self.board.closed:
                newer, snapshot = self.board.wait_newer(version, _WATCH_POLL)
                if newer != version:  # intermediate versions a slow reader missed are skipped
                    version = newer
                    yield snapshot.to_proto()
        finally:
            with self._lock:
                self._watchers -= 1

    # ---- stores ----

    def host_store_call(self, request: pb.HostStoreRequest, _: Context) -> pb.HostStoreResponse:
        epoch = requests.epoch(request.epoch)
        with self._lock:
            if epoch not in self.stores:
                snapshot = self._serving()
                if snapshot.terminating:
                    raise Refused(
                        "terminating: a leaving agent must not host a store (the members of "
                        f"epoch {epoch} would lose it when it goes)"
                    )
                _after_in_effect(epoch, snapshot)
                pending = snapshot.pending
                self._drop_stores(snapshot.observed.epoch, pending.epoch if pending else None)
                spare, self._spare = self._spare, self._make_store()
                try:
                    store = spare.result()
                except RuntimeError as err:  # torch's: no free port, the address is gone
                    raise NotNow(f"cannot host a store on {self.pod_ip}: {err}") from None
                self.stores[epoch] = store
                self.log.info("hosting the store of epoch %s at %s:%s", epoch, self.pod_ip,
                              store.port)  # fmt: skip
            port = self.stores[epoch].port
        return pb.HostStoreResponse(address=pb.StoreAddress(host=self.pod_ip, port=port))

    def _make_store(self) -> Future[Store]:
        """A store started in the background, ready for the next epoch asked for: starting
        torch's TCPStore now and then takes 5 s, which no reconfiguration should wait for."""
        return self._store_maker.submit(
            self.host_store, StoreAddress(self.pod_ip, 0), self.job.deadlines.op
        )

    def _drop_stores(self, *keep: int | None) -> None:
        """Free every hosted store but those of the epochs in `keep` (the one in effect here and
        the one pending): the stores of past and aborted epochs serve nobody, and a store frees
        its socket and thread once dropped."""
        for epoch in [e for e in self.stores if e not in keep]:
            del self.stores[epoch]
            self.log.info("freed the store of epoch %s", epoch)

    # ---- reconfigurations ----

    def prepare(self, request: pb.PrepareRequest, _: Context) -> pb.PrepareResponse:
        order = requests.prepare(request, self.job)
        with self._lock:
            snapshot = self._serving()
            pending = snapshot.pending
            command, seen = order.command, snapshot.observed
            recovery = isinstance(command, Prepare) and recovers(command.change, broken=seen.broken)
            if pending is not None and not (isinstance(command, Prepare) and superseding(
                command.change, pending.epoch, training=seen.training, broken=seen.broken,
                undecided=pending.state is PendingState.UNDECIDED,
            )):  # fmt: skip
                if pending.epoch == order.epoch and self.accepted.get(order.epoch) == request:
                    return pb.PrepareResponse()  # a replay of the request in progress
                raise Refused(
                    f"epoch {pending.epoch} is pending here; abort it or let it switch before "
                    f"preparing epoch {order.epoch}"
                )
            if order.epoch in self.accepted:
                raise InvalidInput(
                    f"epoch={order.epoch} was used before here; each reconfiguration takes a new "
                    "epoch number"
                )
            _after_in_effect(order.epoch, snapshot)
            if seen.broken and not recovery and order.old is not None:
                raise Refused(
                    f"{snapshot.message}; only a recovery (a Prepare naming the dead members "
                    "`lost`, or the same layout again when none is), or a new first world (no "
                    "`from`, restoring a checkpoint) can follow"
                )
            if seen.done:
                raise Refused(f"the job has trained its last step ({snapshot.steps})")
            if snapshot.terminating and self.job.member in order.new.ranks:
                raise Refused(
                    "terminating: this agent received SIGTERM and cannot be a member of `to`"
                )
            if order.old is None and seen.training and not seen.broken:
                raise Refused(
                    f"this agent trains in epoch {seen.epoch}; a first world (no `from`) is "
                    "made of standing-by agents"
                )
            if order.old is not None:
                _from_in_effect(order.old, seen.training, seen.layout, self.job.member)
            deadlines = order.deadlines
            kind = ClaimKind.START if isinstance(order.command, Start) else ClaimKind.CHANGE
            # Known before the loop can take the command: the reporter reads the layouts.
            self.accepted[order.epoch] = request
            self.layouts[order.epoch] = order.new
            self._obey(order.command, kind, order.epoch, order.at_step, order.new,
                       before=lambda: self.use_deadlines(deadlines))  # fmt: skip
        if order.old is None:
            self.log.info("first world, epoch %s, accepted: %s", order.epoch,
                          order.new.describe())  # fmt: skip
        else:
            self.log.info(
                "prepare epoch %s accepted: %s -> %s, %s", order.epoch, order.old.describe(),
                order.new.describe(),
                "held" if order.at_step == -1 else f"switching at step >= {order.at_step}",
            )  # fmt: skip
        return pb.PrepareResponse()

    def switch(self, request: pb.SwitchRequest, _: Context) -> pb.SwitchResponse:
        epoch = requests.epoch(request.epoch)
        at_step = requests.at_step(request.at_step)
        with self._lock:
            snapshot = self._serving()
            pending = snapshot.pending
            if pending is None or pending.epoch != epoch:
                raise Refused(f"epoch {epoch} is not pending here ({_pending_text(snapshot)})")
            if snapshot.claimed(ClaimKind.START):
                raise Refused(f"epoch {epoch} is a first world: it starts without a Switch")
            if pending.state is PendingState.FAILED:
                raise Refused(f"epoch {epoch} failed to prepare: {pending.reason}")
            self._obey(SwitchAt(epoch, at_step), ClaimKind.SWITCH, epoch, at_step)
        self.log.info("epoch %s may switch at step >= %s", epoch, at_step)
        return pb.SwitchResponse()

    def abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        """OK once epoch `epoch` will not switch here (dropped now, given up before, or never
        pending: the drop records the abort as the epoch's decision, so no member can commit
        it any more; `queue_only`: once the drop is queued); ABORTED when it (or a later epoch)
        is in effect: its commit came first."""
        epoch = requests.epoch(request.epoch)
        with self._lock:
            snapshot = self._serving()
            pending = snapshot.pending
            if pending is None or pending.epoch != epoch:
                _nothing_to_abort(epoch, snapshot)
                return pb.AbortResponse()
            if snapshot.claimed(ClaimKind.START):
                raise Refused(
                    f"epoch {epoch} is a first world: its members start it together and it "
                    "cannot be aborted (release the agents, or start another epoch)"
                )
            ticket = self.drops.get(epoch)
            if ticket is None or ticket.settled.is_set():
                ticket = self._obey(Drop(epoch), ClaimKind.DROP, epoch)
                self.drops[epoch] = ticket
        # The member takes the drop at its next step boundary (or once a switch under way ends).
        if request.queue_only:
            self.log.info("epoch %s: abort queued on request", epoch)
            return pb.AbortResponse()
        remaining = context.time_remaining()
        bound = self.job.deadlines.switch + self.job.deadlines.op
        if not ticket.wait(bound if remaining is None else max(min(remaining - 0.2, bound), 0)):
            raise NotNow(f"the abort of epoch {epoch} is queued; call Abort again for its outcome")
        if ticket.error is not None:
            _nothing_to_abort(epoch, self.board.get(), ticket.error)
        self.log.info("epoch %s aborted on request", epoch)
        return pb.AbortResponse()

    # ---- checkpoints ----

    def checkpoint(self, request: pb.CheckpointRequest, _: Context) -> pb.CheckpointResponse:
        if request.number < 0:
            raise InvalidInput(f"number={request.number} must be >= 0 (increasing per job)")
        path = requests.checkpoint_path(request.path)
        at_step = requests.at_step(request.at_step)
        export_to = requests.export_path(request.export_to)
        with self._lock:
            snapshot = self._serving()
            seen = snapshot.observed
            if not seen.training or seen.broken:
                raise Refused(
                    f"this agent is {snapshot.phase.name}: only members of the world in effect "
                    "save a checkpoint"
                )
            if seen.done and at_step > seen.step:
                raise InvalidInput(
                    f"at_step={at_step} is past the job's last step ({seen.step}): a finished "
                    "world saves only its last step"
                )
            due = snapshot.checkpoint_due
            if due is not None and due == request.number:
                if self.checkpoints.get(request.number) == request:
                    return pb.CheckpointResponse()  # a replay
                raise Refused(f"checkpoint {due} is due here with another path or step")
            last = max([n for n in (due, _last_checkpoint(snapshot)) if n is not None], default=-1)
            if request.number <= last:
                raise InvalidInput(
                    f"number={request.number} must be greater than {last}, the last checkpoint "
                    "asked for here"
                )
            self._obey(CheckpointAt(request.number, path, at_step, export_to),
                       ClaimKind.CHECKPOINT, request.number, at_step)  # fmt: skip
            self.checkpoints[request.number] = request
        self.log.info("checkpoint %s to %s at step >= %s accepted", request.number, path, at_step)
        return pb.CheckpointResponse()

    # ---- leaving ----

    def release(self, request: pb.ReleaseRequest, _: Context) -> pb.ReleaseResponse:
        if request.saved < 0:
            raise InvalidInput(f"saved={request.saved} must be >= 0 (a checkpoint number)")
        with self._lock:
            if self.released.is_set():
                return pb.ReleaseResponse()
            snapshot = self.board.get()
            phase = snapshot.phase
            saved = _last_checkpoint(snapshot)
            keeps = not request.discard  # a discarded agent's state goes whatever it holds
            if (phase is Phase.TRAINING and keeps
                    and not (request.saved and (saved or 0) >= request.saved)):  # fmt: skip
                kept = f"; its last checkpoint is {saved}" if request.saved else ""
                raise Refused(
                    f"this agent is a member of the world in effect (epoch "
                    f"{snapshot.observed.epoch}); reconfigure it out before releasing it, or "
                    f"save its state first{kept}"
                )
            if phase is Phase.JOINING and keeps:
                raise Refused(
                    f"this agent is joining a world ({_pending_text(snapshot)}); abort it first"
                )
            self.released.set()
            if request.discard:
                self.discarded.set()
            self._obey(Stop(), ClaimKind.STOP, 0)
        if request.discard:
            self.log.warning("discarded in phase %s (its job is gone): exiting unsaved", phase.name)
        else:
            self.log.info("released in phase %s: exiting", phase.name)
        return pb.ReleaseResponse()

    # ---- certificates ----

    def rotate_certificate(
        self, request: pb.RotateCertificateRequest, _: Context
    ) -> pb.RotateCertificateResponse:
        if self.serving is None:
            raise Refused("this agent serves its API in plaintext: it has no certificate")
        serving = self.serving.replace(request.cert, request.key, request.ca)
        self.board.update(lambda s: replace(s, serving=serving))
        self.log.info(
            "serving certificate rotated%s: new connections get %s",
            " with the CAs it trusts" if request.ca else "", serving[:16],
        )  # fmt: skip
        return pb.RotateCertificateResponse()

    # ---- helpers ----

    def _serving(self) -> Snapshot:
        """The snapshot, if the agent takes commands at all."""
        snapshot = self.board.get()
        if self.released.is_set():
            raise Refused("released: the agent is exiting")
        if snapshot.failure:
            raise Refused(f"the agent failed and can train no more: {snapshot.failure}")
        return snapshot

    def _obey(
        self,
        command: Command,
        kind: ClaimKind,
        number: int,
        at_step: int = 0,
        layout: Layout | None = None,
        before: Callable[[], None] | None = None,
    ) -> Ticket:
        """Queue `command` for the member's loop, claimed on the status board until the loop
        settles it. The claim is shown before the loop can take the command: the loop drops a
        claim as it settles its ticket, and one shown after a quick settling (the handler's thread
        kept off the CPU meanwhile) would stay for ever, an epoch the member took still pending
        here and refusing every later Prepare."""

        def claim(ticket: Ticket) -> None:
            made = Claim(ticket.number, kind, number, at_step, layout)
            self.board.update(lambda s: replace(s, claims=(*s.claims, made)))

        return self.inbox.put(command, before, claim)


def _after_in_effect(epoch: int, snapshot: Snapshot) -> None:
    if epoch <= snapshot.observed.epoch:
        raise InvalidInput(
            f"epoch={epoch} is not after the epoch in effect here, {snapshot.observed.epoch}"
        )


def _from_in_effect(old: Layout, training: bool, current: Layout | None, me: str) -> None:
    if training:
        if old != current:
            assert current is not None
            raise InvalidInput(
                f"from: {old.describe()} members {list(old.members)} is not the layout in "
                f"effect here, {current.describe()} members {list(current.members)}"
            )
    elif me in old.ranks:
        raise InvalidInput(f"from.members: this agent, {me!r}, trains in no world here")


def _nothing_to_abort(epoch: int, snapshot: Snapshot, refusal: str | None = None) -> None:
    """Return when epoch `epoch` will not switch here; raise Overtaken when it already has."""
    last = snapshot.last_switch
    if last is not None and last.epoch == epoch:
        if last.result is Result.COMMITTED:
            raise Overtaken(f"epoch {epoch} switched (committed at step {last.step})")
        return  # given up before
    if epoch <= snapshot.observed.epoch:
        raise Overtaken(
            f"epoch {epoch} is not after the epoch in effect here, {snapshot.observed.epoch}"
        )
    if refusal is not None and snapshot.pending is not None and snapshot.pending.epoch == epoch:
        raise Refused(refusal)


def _pending_text(snapshot: Snapshot) -> str:
    pending = snapshot.pending
    if pending is None:
        return "nothing is pending"
    return f"{pending.epoch} is pending, {pending.state.name.lower()}"


def _last_checkpoint(snapshot: Snapshot) -> int | None:
    return snapshot.last_checkpoint.number if snapshot.last_checkpoint else None
