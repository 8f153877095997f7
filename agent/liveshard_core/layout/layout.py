"""A layout: the members of a world and how they split the model (dp, tp, pp, ep, ZeRO).

Conventions (docs/layouts.md states them in full):
- rank order: tp fastest, then dp, then pp: `rank = pp_i*dp*tp + dp_i*tp + tp_i`;
- ep is carved out of dp: a rank's ep rank is `dp_i % ep`;
- `pp_layers` gives the number of transformer layers per stage; by default the first
  `layers % pp` stages hold one extra layer;
- `mirror`: no byte of the state has a single holder. Each ZeRO shard is also held by the next
  member of its shard group, in dp order and round; a box that no replica holds (any box of a
  layout with dp = 1, an expert of ep = dp) is also held by the next member along dp (an
  expert), else along pp, else along tp (a split tensor), round (`region.place`,
  `region.Geometry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ..errors import InvalidInput
from ..vps.spec import ModelSpec

ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True)
class Layout:
    """Degrees, ZeRO stage, pipeline partition and the members in rank order."""

    dp: int
    tp: int
    pp: int
    ep: int
    zero: int
    pp_layers: tuple[int, ...]
    members: tuple[str, ...] = field(repr=False)
    mirror: bool = False

    @staticmethod
    def can_mirror(dp: int, tp: int, pp: int, ep: int, zero: int) -> bool:
        """Whether some byte has a single holder and another member to be mirrored by: ZeRO
        shards over dp >= 2, the boxes of a layout with dp = 1 on several members, experts of
        ep = dp >= 2."""
        return (zero > 0 and dp >= 2) or (dp == 1 and tp * pp >= 2) or ep == dp >= 2

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidInput(f"layout: {name}={value!r} must be an integer >= 1")
        if type(self.zero) is not int or self.zero not in ZERO_STAGES:
            raise InvalidInput(
                f"layout: zero={self.zero!r} must be one of {ZERO_STAGES} "
                "(ZeRO-2 differs from 1 only in gradients, which no switch carries)"
            )
        if self.dp % self.ep:
            raise InvalidInput(
                f"layout: ep={self.ep} must divide dp={self.dp} (ep is carved out of dp)"
            )
        if len(self.pp_layers) != self.pp or any(n < 1 for n in self.pp_layers):
            raise InvalidInput(
                f"layout: pp_layers={list(self.pp_layers)} must list pp={self.pp} stages "
                "of at least 1 layer"
            )
        if len(self.members) != self.world_size:
            raise InvalidInput(
                f"layout: {len(self.members)} members given, but dp*tp*pp = {self.world_size}"
            )
        if len(set(self.members)) != len(self.members):
            raise InvalidInput("layout: a member appears twice in the member list")
        if type(self.mirror) is not bool:
            raise InvalidInput(f"layout: mirror={self.mirror!r} must be a boolean")
        if self.mirror and not self.can_mirror(self.dp, self.tp, self.pp, self.ep, self.zero):
            raise InvalidInput(
                f"layout: mirror needs bytes held once and another member to take them (ZeRO "
                f"shards over dp >= 2, dp=1 on several members, or experts of ep=dp >= 2), not "
                f"{self.describe()}"
            )

    @classmethod
    def create(
        cls,
        spec: ModelSpec,
        members: tuple[str, ...] | list[str],
        *,
        dp: int = 1,
        tp: int = 1,
        pp: int | None = None,
        ep: int = 1,
        zero: int = 0,
        pp_layers: tuple[int, ...] | None = None,
        mirror: bool = False,
    ) -> Layout:
        """A layout for `spec`, checked for feasibility. Without `pp_layers` the partition is
        balanced; without `pp`, there are as many stages as `pp_layers` lists (or one)."""
        layers = spec.config.layers
        if pp is None:
            pp = 1 if pp_layers is None else len(pp_layers)
        if pp_layers is None:
            if type(pp) is not int or not 1 <= pp <= layers:
                raise InvalidInput(f"layout: pp={pp!r} must be between 1 and the {layers} layers")
            pp_layers = tuple(layers // pp + (1 if s < layers % pp else 0) for s in range(pp))
        layout = cls(dp, tp, pp, ep, zero, tuple(pp_layers), tuple(members), mirror)
        layout.check(spec)
        return layout

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @cached_property
    def ranks(self) -> dict[str, int]:
        """Each member's rank."""
        return dict(zip(self.members, range(len(self.members)), strict=True))

    def rank_of(self, member: str) -> int:
        try:
            return self.ranks[member]
        except KeyError:
            raise InvalidInput(
                f"{member!r} is not a member of the layout {self.describe()}"
            ) from None

    @cached_property
    def stage_of_layer(self) -> tuple[int, ...]:
        return tuple(s for s, n in enumerate(self.pp_layers) for _ in range(n))

    def rank(self, pp_i: int, dp_i: int, tp_i: int) -> int:
        return (pp_i * self.dp + dp_i) * self.tp + tp_i

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_i, dp_i, tp_i) of a rank."""
        if not 0 <= rank < self.world_size:
            raise InvalidInput(f"rank {rank} outside a layout of {self.world_size} ranks")
        rest, tp_i = divmod(rank, self.tp)
        pp_i, dp_i = divmod(rest, self.dp)
        return pp_i, dp_i, tp_i

    def check(self, spec: ModelSpec) -> None:
        """Raise ValueError naming the first constraint of `spec` this layout breaks."""
        cfg = spec.config
        divides = [("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("vocab", cfg.vocab)]
        divides.append(("expert_ffn", cfg.expert_ffn) if cfg.experts else ("ffn", cfg.ffn))
        for name, value in divides:
            if value % self.tp:
                raise InvalidInput(f"layout: tp={self.tp} must divide {name}={value} of {cfg.name}")
        if self.ep > 1 and (not cfg.experts or cfg.experts % self.ep):
            raise InvalidInput(
                f"layout: ep={self.ep} must divide the number of experts "
                f"({cfg.experts}) of {cfg.name}"
            )
        if sum(self.pp_layers) != cfg.layers:
            raise InvalidInput(
                f"layout: pp_layers={list(self.pp_layers)} sums to {sum(self.pp_layers)}, "
                f"but {cfg.name} has {cfg.layers} layers"
            )

    @property
    def degrees(self) -> Degrees:
        """The layout without its members (its pipeline partition included)."""
        return Degrees(
            dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, zero=self.zero,
            pp_layers=self.pp_layers, mirror=self.mirror,
        )  # fmt: skip

    def describe(self) -> str:
        """The layout in the command-line syntax, without members."""
        return self.degrees.describe()


@dataclass(frozen=True)
class Degrees:
    """A layout before it has members: what the command line and a job spec give."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    pp_layers: tuple[int, ...] | None = None
    mirror: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def repartitioned(self, pp_layers: tuple[int, ...]) -> Degrees:
        """These degrees with the pipeline partition `pp_layers` (and as many stages), mirrored
        as they were where they still can be (one stage of dp = 1 has no one to mirror it)."""
        return replace(self, pp=len(pp_layers), pp_layers=tuple(pp_layers)).mirrored(self.mirror)

    def mirrored(self, wanted: bool) -> Degrees:
        """These degrees mirrored (`Layout.mirror`) when `wanted` and some byte is held once."""
        can = Layout.can_mirror(self.dp, self.tp, self.pp, self.ep, self.zero)
        return replace(self, mirror=wanted and can)

    def describe(self) -> str:
        """In the command-line syntax (`parse_degrees` reads it back)."""
        text = f"dp={self.dp},tp={self.tp},pp={self.pp},ep={self.ep},zero={self.zero}"
        if self.pp_layers is not None:
            text += f",pp_layers={':'.join(map(str, self.pp_layers))}"
        return text + (",mirror=1" if self.mirror else "")

    def layout(self, spec: ModelSpec, members: tuple[str, ...] | list[str]) -> Layout:
        return Layout.create(
            spec, members, dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, zero=self.zero,
            pp_layers=self.pp_layers, mirror=self.mirror,
        )  # fmt: skip


_KEYS = ("dp", "tp", "pp", "ep", "zero", "pp_layers", "mirror")


def parse_degrees(text: str) -> Degrees:
    """Parse `tp=8,pp=8,dp=16,zero=1[,ep=E][,pp_layers=A:B:...][,mirror=1]`; unset degrees
    are 1, `mirror` 0."""
    values: dict[str, int] = {}
    pp_layers: tuple[int, ...] | None = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise InvalidInput(
                f"layout {text!r}: bad item {item!r}; expected KEY=VALUE with KEY in {_KEYS}"
            )
        if key in values or (key == "pp_layers" and pp_layers is not None):
            raise InvalidInput(f"layout {text!r}: {key} given twice")
        try:
            if key == "pp_layers":
                pp_layers = tuple(int(n) for n in raw.split(":"))
            else:
                values[key] = int(raw)
        except ValueError:
            raise InvalidInput(f"layout {text!r}: {key}={raw!r} is not an integer") from None
    if pp_layers is not None:
        values.setdefault("pp", len(pp_layers))
    mirror = values.pop("mirror", 0)
    if mirror not in (0, 1):
        raise InvalidInput(f"layout {text!r}: mirror={mirror} must be 0 or 1")
    return Degrees(**values, pp_layers=pp_layers, mirror=bool(mirror))
