"""Tasks the pipeline tests run inside worker processes (`liveshard_e2e.workers.Pool`), gloo, CPU:
one member's training step with the activations autograd saves metered (`ActivationMeter`).

The meter is the test's, installed around the step with torch's saved-tensor hooks and a wrapper
of the stage's forward that numbers the micro-batches: the product measures nothing for it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from liveshard_agent.engine.world import StoreAddress, World, connect_store, host_store
from liveshard_agent.runtime.data import job_dataset
from liveshard_agent.runtime.model import Output, StageModel
from liveshard_agent.runtime.trainer import Scalars, Trainer, initial_state
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import parse_degrees
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import ModelSpec

CONTEXT: dict[str, Any] = {}
CPU = torch.device("cpu")


class _Held:
    """A saved tensor as autograd keeps it: dropping it (after the backward) releases it."""

    def __init__(self, meter: ActivationMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)


class ActivationMeter:
    """The storages autograd holds for backward, each counted once, by the micro-batch whose
    forward saved it: the bytes and the number of micro-batches held at once, and their peaks.
    Storages that outlive a micro-batch (the parameters, the rotary tables, anything two
    micro-batches save) are not activations and are left out."""

    def __init__(self, resident: set[int]) -> None:
        self.resident = resident
        self.micro = -1  # the micro-batch whose forward runs
        self.entries: dict[int, list[int]] = {}  # storage: [micro-batch, references, bytes]
        self.by_micro: Counter[int] = Counter()  # live storages of each micro-batch
        self.bytes = self.peak_bytes = self.peak_micro_batches = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.resident or storage.nbytes() == 0:
            return tensor
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = [self.micro, 1, storage.nbytes()]
            self.by_micro[self.micro] += 1
            self.bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            held = sum(1 for n in self.by_micro.values() if n)
            self.peak_micro_batches = max(self.peak_micro_batches, held)
            return _Held(self, key, tensor)
        if entry[0] != self.micro:  # shared across micro-batches: resident, not an activation
            self._drop(key)
            self.resident.add(key)
            return tensor
        entry[1] += 1
        return _Held(self, key, tensor)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self._drop(key)

    def _drop(self, key: int) -> None:
        micro, _, nbytes = self.entries.pop(key)
        self.by_micro[micro] -= 1
        self.bytes -= nbytes


def host() -> int:
    """Host the store in this worker; returns its port."""
    CONTEXT["store"] = host_store(StoreAddress("127.0.0.1", 0), timeout=30)
    return int(CONTEXT["store"].port)


def step(
    member: str,
    port: int,
    epoch: int,
    model: str,
    layout: str,
    members: list[str],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """One training step of `member` in a fresh world, metered: its stage, its loss, the peak
    of the activations it held (micro-batches and bytes) and the bytes one micro-batch saves."""
    training = TrainingSettings(**settings)
    spec = ModelSpec.from_config(resolve_model(model).config)
    shape = parse_degrees(layout).layout(spec, members)
    rank = shape.rank_of(member)
    store = CONTEXT.get("store") or connect_store(StoreAddress("127.0.0.1", port), timeout=30)
    CONTEXT["world"] = None  # the previous task's groups go first
    world = World.build(
        store, epoch=epoch, tag="test", layout=shape, member=member, device=CPU, timeout=60
    )
    CONTEXT["world"] = world
    trainer = Trainer(
        state=initial_state(spec, shape, rank, training.seed, CPU), world=world,
        settings=training, dataset=job_dataset(training, None, spec.config.vocab),
        scalars=Scalars(seed=training.seed),
    )  # fmt: skip
    stage: StageModel = trainer.model
    resident = {t.untyped_storage().data_ptr() for _, _, t in trainer.state.items()}
    resident |= {t.untyped_storage().data_ptr() for t in stage.rope}
    meter = ActivationMeter(resident)
    forward = stage.forward

    def numbered(*args: Any) -> Output:
        meter.micro += 1
        return forward(*args)

    stage.forward = numbered  # type: ignore[method-assign]
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        record = trainer.step()
    return {
        "stage": shape.coords(rank)[0],
        "loss": record.loss,
        "peak_micro_batches": meter.peak_micro_batches,
        "peak_bytes": meter.peak_bytes,
        "left_bytes": meter.bytes,
    }
