"""Transfer plans: which member sends which box of which logical tensor when the layout changes.

A plan is a pure function of (model spec, old layout, new layout, lost members, pods). Members are
named by slot (`union`). Members in both layouts keep what they hold (a local copy); every other
byte a new rank needs comes from one old holder, one in its own pod when there is one (`pods`).
A recovery reads a ZeRO-1 layout's parameters from their shard's holders only (`source_layout`).
Tensors placed alike form a class (`classes`) whose pieces are computed once, so planning cost
follows the number of distinct pieces, not ranks x tensors.

Invariants (property-tested): every byte of every new region is covered exactly once; network
bytes equal the lower bound (`bounds`); the plan is identical wherever it is computed.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..errors import InvalidInput, NoSurvivingCopy
from ..layout.layout import Layout
from ..layout.region import Placed
from ..vps.box import volume
from ..vps.spec import ModelSpec, StateKind, TensorRef
from .classes import TensorClass, tensor_classes
from .matching import LostPiece, Piece, Slot, pattern_pieces
from .union import Pods, Union

PLANNER_VERSION = 5  # 5: a needer takes a piece from a holder in its own pod when one holds it


@dataclass(frozen=True)
class Pattern:
    """The pieces of one tensor class, shared by every tensor of the class."""

    pieces: tuple[Piece, ...]

    @cached_property
    def network(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.src != p.dst)

    @cached_property
    def local_elements(self) -> int:
        return sum(volume(p.box) for p in self.pieces if p.src == p.dst)

    @cached_property
    def slot_elements(self) -> tuple[dict[Slot, int], dict[Slot, int]]:
        """Elements each slot sends and receives over the network, per tensor."""
        sends: dict[Slot, int] = defaultdict(int)
        recvs: dict[Slot, int] = defaultdict(int)
        for p in self.network:
            n = volume(p.box)
            sends[p.src] += n
            recvs[p.dst] += n
        return dict(sends), dict(recvs)

    @cached_property
    def local_by_slot(self) -> dict[Slot, tuple[Piece, ...]]:
        """The local copies of each slot, per tensor."""
        out: dict[Slot, list[Piece]] = defaultdict(list)
        for p in self.pieces:
            if p.src == p.dst:
                out[p.src].append(p)
        return {s: tuple(ps) for s, ps in out.items()}

    @cached_property
    def network_by_slot(self) -> dict[Slot, tuple[int, ...]]:
        """Indices into `network` of the pieces each slot sends or receives."""
        out: dict[Slot, list[int]] = defaultdict(list)
        for i, p in enumerate(self.network):
            out[p.src].append(i)
            out[p.dst].append(i)
        return {s: tuple(ix) for s, ix in out.items()}


@dataclass(frozen=True)
class PlanGroup:
    """A class of tensors and the pattern of pieces they share."""

    pattern: int  # index into Plan.patterns; use Plan.pattern_of
    tensors: TensorClass

    @property
    def itemsize(self) -> int:
        return self.tensors.itemsize


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    old: Layout
    new: Layout
    members: tuple[str, ...]  # the union, indexed by slot
    patterns: tuple[Pattern, ...]
    groups: tuple[PlanGroup, ...] = field(repr=False)
    lost: frozenset[str] = frozenset()
    pods: Pods = field(default_factory=dict)

    def pattern_of(self, group: PlanGroup) -> Pattern:
        return self.patterns[group.pattern]

    @cached_property
    def _slots(self) -> dict[str, Slot]:
        return {m: i for i, m in enumerate(self.members)}

    def slot_of(self, member: str) -> Slot:
        """`member`'s slot; ValueError if it takes no part in the plan."""
        try:
            return self._slots[member]
        except KeyError:
            raise InvalidInput(f"member {member!r} is a live member of neither layout") from None

    def items(self) -> list[tuple[TensorRef, int, Piece]]:
        """Every (tensor, itemsize, piece) of the plan, expanded; for tests on small models."""
        return [
            (ref, g.itemsize, p)
            for g in self.groups
            for ref in g.tensors.tensors
            for p in self.pattern_of(g).pieces
        ]

    def local_copies(self, slot: Slot) -> list[tuple[TensorRef, Piece]]:
        """What `slot` copies from its old state into its new one."""
        return [
            (ref, p)
            for g in self.groups
            for p in self.pattern_of(g).local_by_slot.get(slot, ())
            for ref in g.tensors.tensors
        ]

    @cached_property
    def network_pieces(self) -> int:
        return sum(len(g.tensors) * len(self.pattern_of(g).network) for g in self.groups)

    def _bytes(self, elements: int, group: PlanGroup) -> int:
        return elements * group.itemsize * len(group.tensors)

    @cached_property
    def network_bytes(self) -> int:
        return sum(
            self._bytes(sum(volume(p.box) for p in self.pattern_of(g).network), g)
            for g in self.groups
        )

    def across_pods_bytes(self, pods: Pods | None = None) -> int:
        """Network bytes between members that share no pod, by `pods` (else the plan's own)."""
        pod = [(self.pods if pods is None else pods).get(m) for m in self.members]
        return sum(
            self._bytes(volume(p.box), g)
            for g in self.groups
            for p in self.pattern_of(g).network
            if pod[p.src] is None or pod[p.src] != pod[p.dst]
        )

    @cached_property
    def local_bytes(self) -> int:
        return sum(self._bytes(self.pattern_of(g).local_elements, g) for g in self.groups)

    @cached_property
    def slot_bytes(self) -> tuple[dict[Slot, int], dict[Slot, int]]:
        """Network bytes each slot sends and receives in the whole plan."""
        sends: dict[Slot, int] = defaultdict(int)
        recvs: dict[Slot, int] = defaultdict(int)
        for g in self.groups:
            pattern_sends, pattern_recvs = self.pattern_of(g).slot_elements
            for slot, n in pattern_sends.items():
                sends[slot] += self._bytes(n, g)
            for slot, n in pattern_recvs.items():
                recvs[slot] += self._bytes(n, g)
        return dict(sends), dict(recvs)

    @cached_property
    def digest(self) -> str:
        return change_digest(self.spec, self.old, self.new, self.lost, self.pods)


def change_digest(
    spec: ModelSpec, old: Layout, new: Layout, lost: frozenset[str], pods: Pods | None = None
) -> str:
    """SHA-256 over everything a plan is a function of: the planner's version, the model, both
    layouts with their members, the lost members and the pods. Members compare it before moving
    any byte: equal digests mean equal plans wherever computed (planning is deterministic,
    tested across processes), also by members that compute only their own part
    (`view.member_plan`)."""
    h = hashlib.sha256()
    h.update(repr((PLANNER_VERSION, spec.digest, old.describe(), new.describe())).encode())
    for members in (old.members, new.members, sorted(lost)):
        h.update("\0".join(members).encode() + b"\1")
    for member, pod in sorted((pods or {}).items()):
        h.update(f"{member}\0{pod}\1".encode())
    return h.hexdigest()


def build_plan(
    spec: ModelSpec,
    old: Layout,
    new: Layout,
    lost: frozenset[str] = frozenset(),
    pods: Pods | None = None,
) -> Plan:
    """The full plan from `old` to `new`; both layouts must be feasible for `spec`.

    `lost` members died with their state: the plan takes every byte from surviving copies, and
    raises ValueError naming a tensor that has none. `pods` names the pod of members that share
    one: a member takes a piece from a holder in its pod when there is one.
    """
    old.check(spec)
    new.check(spec)
    union = Union(old, new, lost, pods)
    source = source_layout(old, lost)
    pattern_index: dict[tuple[Placed, Placed], int] = {}
    patterns: list[Pattern] = []
    groups = []
    for cls in tensor_classes(spec, source, new):
        key = (cls.old, cls.new)
        if key not in pattern_index:
            pattern_index[key] = len(patterns)
            with lost_tensor(spec, cls, lost, source is not old):
                patterns.append(Pattern(tuple(pattern_pieces(union, cls.old, cls.new))))
        groups.append(PlanGroup(pattern_index[key], cls))
    return Plan(
        spec, old, new, union.members, tuple(patterns), tuple(groups), lost, dict(pods or {})
    )


def source_layout(old: Layout, lost: frozenset[str]) -> Layout:
    """The layout whose geometry says which old members a change reads each byte from: `old`,
    but for a recovery (a change with `lost` members) from ZeRO-1, which reads parameters from
    their shard's holders only, as under ZeRO-3. A world can break inside the parameter sharing
    that follows an update (a member dies in its all-reduce): each member has then written the
    update into its own shards' rows (a mirrored layout's too) but holds the other rows one step
    old, or some of them new where the all-reduce completed; the shard's holders have the update
    either way. (A rebuild, none lost, shares the update again instead: `Trainer.reshare`.)"""
    return replace(old, zero=3) if lost and old.zero == 1 else old


@contextmanager
def lost_tensor(
    spec: ModelSpec, cls: TensorClass, lost: frozenset[str], from_shards: bool = False
) -> Iterator[None]:
    """Turn a piece no live member holds into an error naming the tensor; a parameter read
    from its shard's holders (`from_shards`) by its optimizer state, which they alone held."""
    try:
        yield
    except LostPiece as err:
        ref = cls.tensor(0)
        if from_shards and ref.kind is StateKind.PARAM:
            ref = TensorRef(ref.param, next(k for k in spec.kinds if k is not StateKind.PARAM))
        name = spec.tensor_name(ref)
        raise NoSurvivingCopy(
            f"no surviving copy of {name} {list(err.box)} (and of every tensor placed "
            f"like it): every member that held it is lost ({sorted(lost)}); "
            "restore from a checkpoint"
        ) from None
