"""Training settings: the global batch, micro-batches, the schedule of the learning rate, the seed.

The global batch is fixed for the whole job: a layout's data-parallel degree only changes how many
micro-batches each replica runs (`micro_batches`). A layout whose global batch does not divide into
dp x micro-batch is rejected before any byte moves, with an error naming the numbers.

Each field is one setting everywhere: `spec.training.<camelCase>` in the CRD (or
`spec.<section>.<camelCase>` where its `crd` metadata names another section: the pipeline schedule
is a parallelism field there), `--<kebab-case>` of `liveshard-local` (see `flags`), the field's own
name in the agent's JSON. Its `help` metadata is the flag's help text, its `choices` metadata (if
any) the values it may take. One setting is a list, `freeze`: a list of `{step, layers}` objects in
the CRD and the JSON, one `--freeze STEP:LAYERS` flag per entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import InvalidInput
from ..vps.spec import Param

DATA_ORDERS = ("shuffled", "sequential")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
FREEZE_KEYS = ("step", "layers")  # an entry of `freeze`, as the CRD and the JSON spell it


def _setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    crd: str = "training",
    metavar: str | None = None,
    example: str | None = None,
) -> Any:
    metadata: dict[str, Any] = {"help": help, "crd": crd}
    if choices is not None:
        metadata["choices"] = choices
    if metavar is not None:  # a list setting: how one flag spells an entry, for example
        metadata["metavar"], metadata["example"] = metavar, example
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainingSettings:
    """What a job trains with; identical on every member (part of every switch's agreement)."""

    global_batch: int = _setting(24, "samples per step, whatever the layout")
    micro_batch: int = _setting(2, "samples per micro-batch; must divide the global batch")
    seq_len: int = _setting(64, "tokens per sample")
    steps: int = _setting(100, "training steps")
    seed: int = _setting(0, "seeds the data order, initialisation and dropout")
    lr: float = _setting(3e-3, "peak learning rate")
    min_lr: float | None = _setting(None, "learning rate at the last step (default: lr / 10)")
    warmup_steps: int = _setting(10, "steps of linear warm-up")
    weight_decay: float = _setting(0.1, "AdamW weight decay")
    beta1: float = _setting(0.9, "Adam beta1")
    beta2: float = _setting(0.95, "Adam beta2")
    eps: float = _setting(1e-8, "Adam epsilon")
    clip_norm: float = _setting(1.0, "clip the gradient to this global norm")
    dropout: float = _setting(
        0.0, "dropout on each residual branch's output, from counter-based randomness"
    )
    aux_loss_coef: float = _setting(0.01, "weight of the MoE load-balancing loss")
    data: str | None = _setting(
        None,
        "a prepared token directory (liveshard-data prepare), or text (jsonl, parquet, text "
        "files or a folder) tokenized on first use; without a tokenizer, a file whose bytes are "
        "the tokens (default: the built-in corpus)",
    )
    tokenizer: str | None = _setting(
        None, "a tokenizer.json (default: the model directory's, if it has one)"
    )
    data_order: str = _setting(
        "shuffled",
        "sequential, or shuffled: a permutation of the samples that the seed fixes",
        choices=DATA_ORDERS,
    )
    pipeline_schedule: str = _setting(
        "1f1b",
        "the order of a stage's micro-batches: 1f1b (one forward, one backward: a stage holds "
        "at most pp micro-batches' activations) or gpipe (all forwards, then all backwards: it "
        "holds all of them); the same losses",
        choices=PIPELINE_SCHEDULES,
        crd="parallelism",
    )
    freeze: tuple[tuple[int, int], ...] = _setting(
        (),
        "from step STEP on, the first LAYERS transformer layers are frozen: no gradient, no "
        "update (and the input embedding, unless tied, once LAYERS >= 1); repeatable, the last "
        "entry whose STEP has come applies, e.g. 20:2 then 40:4",
        metavar="STEP:LAYERS",
        example="20:2",
    )

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "seq_len", "steps"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidInput(f"training: {name}={value!r} must be an integer >= 1")
        if self.global_batch % self.micro_batch:
            raise InvalidInput(
                f"training: micro_batch={self.micro_batch} must divide "
                f"global_batch={self.global_batch}"
            )
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise InvalidInput(
                    f"training: {f.name}={getattr(self, f.name)!r} must be one of {list(choices)}"
                )
        if not 0 <= self.dropout < 1:
            raise InvalidInput(f"training: dropout={self.dropout} must be in [0, 1)")
        object.__setattr__(self, "freeze", _freeze_entries(self.freeze))
        if self.min_lr is None:
            object.__setattr__(self, "min_lr", self.lr / 10)
        if self.lr <= 0 or self.final_lr < 0 or self.final_lr > self.lr:
            raise InvalidInput(
                f"training: need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}) and lr > 0"
            )

    @property
    def final_lr(self) -> float:
        """The learning rate at the last step (`min_lr`, resolved)."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def micro_batches(self, dp: int) -> int:
        """Micro-batches each of `dp` replicas runs per step; InvalidInput if they do not divide."""
        per_step = dp * self.micro_batch
        if self.global_batch % per_step:
            raise InvalidInput(
                f"global batch {self.global_batch} does not divide into dp={dp} replicas x "
                f"micro-batches of {self.micro_batch} samples ({per_step} per round); choose a "
                f"dp that divides {self.global_batch // self.micro_batch}"
            )
        return self.global_batch // per_step

    def frozen_layers(self, step: int) -> int:
        """How many of the first layers are frozen at `step`: the layers of the last `freeze`
        entry whose step has come (0 before the first)."""
        layers = 0
        for start, count in self.freeze:
            if start > step:
                break
            layers = count
        return layers

    def frozen(self, step: int, param: Param) -> bool:
        """Whether `param` takes no update at `step`: a weight of a frozen layer, or the input
        embedding once a layer is frozen, unless the head shares it (a tied embedding still
        trains through the head). The same answer on every rank, in every layout."""
        layers = self.frozen_layers(step)
        if param.layer is not None:
            return param.layer < layers
        return param.name == "embed" and not param.aliases and layers >= 1

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to `min_lr` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(self.steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        low = self.final_lr
        return low + 0.5 * (self.lr - low) * (1 + math.cos(math.pi * progress))

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["freeze"] = [dict(zip(FREEZE_KEYS, entry, strict=True)) for entry in self.freeze]
        return data

    @classmethod
    def from_crd(cls, spec: dict[str, Any]) -> TrainingSettings:
        """The settings of an ElasticTrainingJob's spec: `spec.training.<camelCase>`, and each
        setting whose `crd` metadata names another section at `spec.<section>.<camelCase>`
        (`spec.parallelism.pipelineSchedule`). Errors name the field as the CRD spells it."""
        settings = cls.from_dict(spec.get("training") or {}, "spec.training", camel, "training")
        elsewhere: dict[str, tuple[Any, str]] = {}
        for f in fields(cls):
            section, name = f.metadata["crd"], camel(f.name)
            values = spec.get(section)
            if section != "training" and isinstance(values, dict) and name in values:
                where = f"spec.{section}.{name}"
                elsewhere[f.name] = (_typed(values[name], f.type, where), where)
        try:
            return replace(settings, **{name: value for name, (value, _) in elsewhere.items()})
        except InvalidInput as err:
            message = str(err).removeprefix("training: ")
            for name, (_, where) in elsewhere.items():
                message = message.replace(f"{name}=", f"{where}=")
            raise InvalidInput(message) from None

    @classmethod
    def from_dict(
        cls,
        data: Any,
        where: str = "training",
        key: Callable[[str], str] = lambda name: name,
        section: str | None = None,
    ) -> TrainingSettings:
        """The settings from a mapping whose keys are `key(field name)` (the field names, or
        the CRD's camelCase); a missing key takes the default. With `section`, only the settings
        the CRD holds in that section are valid keys. Errors name `where.key`."""
        if not isinstance(data, dict):
            raise InvalidInput(f"{where} must be an object of settings, got {type(data).__name__}")
        by_key = {key(f.name): f for f in fields(cls) if section in (None, f.metadata["crd"])}
        unknown = sorted(set(data) - set(by_key))
        if unknown:
            raise InvalidInput(
                f"{where}: unknown field(s) {unknown}; valid fields: {sorted(by_key)}"
            )
        values = {
            by_key[name].name: _typed(raw, by_key[name].type, f"{where}.{name}")
            for name, raw in data.items()
        }
        try:
            return cls(**values)
        except InvalidInput as err:
            message = str(err).removeprefix("training: ")
            for name in values:
                message = message.replace(f"{name}=", f"{key(name)}=")
            raise InvalidInput(f"{where}.{message}") from None


def setting_type(annotation: Any) -> type:
    """The value type of a setting's annotation (`int`, `float`, `str`, or `tuple` for a list
    of entries)."""
    text = str(annotation)
    for kind in (int, float, str, tuple):
        if text.startswith(kind.__name__):
            return kind
    raise TypeError(f"a setting of type {text} has no parser")


def _typed(raw: Any, annotation: Any, where: str) -> Any:
    kind, optional = setting_type(annotation), "None" in str(annotation)
    if raw is None and optional:
        return None
    if kind is tuple:
        return _typed_entries(raw, where)
    if kind is int:
        if type(raw) is not int:
            raise InvalidInput(f"{where}={raw!r} must be an integer")
        return raw
    if kind is float:
        if type(raw) not in (int, float) or not math.isfinite(raw):
            raise InvalidInput(f"{where}={raw!r} must be a number")
        return float(raw)
    if not isinstance(raw, str):
        raise InvalidInput(f"{where}={raw!r} must be a {'path or null' if optional else 'string'}")
    return raw


def _typed_entries(raw: Any, where: str) -> tuple[tuple[int, ...], ...]:
    """A list of `{step, layers}` objects (the CRD's and the JSON's `freeze`) as its entries."""
    if not isinstance(raw, list):
        raise InvalidInput(f"{where}={raw!r} must be a list of {{step, layers}} objects")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != set(FREEZE_KEYS):
            raise InvalidInput(
                f"{where}[{i}]={item!r} must be an object with exactly the fields "
                f"{list(FREEZE_KEYS)}"
            )
        entries.append(tuple(_typed(item[k], "int", f"{where}[{i}].{k}") for k in FREEZE_KEYS))
    return tuple(entries)


def _freeze_entries(value: Any) -> tuple[tuple[int, int], ...]:
    """`freeze` as a tuple of (step, layers) pairs, checked: integers >= 0, steps strictly
    increasing."""
    if not isinstance(value, tuple | list):
        raise InvalidInput(f"training: freeze={value!r} must be a list of (step, layers) pairs")
    entries: list[tuple[int, int]] = []
    for i, entry in enumerate(value):
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise InvalidInput(f"training: freeze[{i}]={entry!r} must be a (step, layers) pair")
        for key, number in zip(FREEZE_KEYS, entry, strict=True):
            if type(number) is not int or number < 0:
                raise InvalidInput(
                    f"training: freeze[{i}].{key}={number!r} must be an integer >= 0"
                )
        if entries and entry[0] <= entries[-1][0]:
            raise InvalidInput(
                f"training: freeze[{i}].step={entry[0]} must be greater than "
                f"freeze[{i - 1}].step={entries[-1][0]}: steps strictly increase"
            )
        entries.append((entry[0], entry[1]))
    return tuple(entries)


def camel(name: str) -> str:
    """A field's name as the CRD spells it: `global_batch` -> `globalBatch`."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
