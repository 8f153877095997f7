"""Checkpoints: `torch.distributed.checkpoint` (DCP) save and load of the sharded state, keyed by
logical tensor name, so a checkpoint written in one layout loads into any other.

Each logical tensor (`layers.0.attn.qkv`, `layers.0.attn.qkv:exp_avg`, ...) is saved at its global
shape as a ShardedTensor whose metadata is the saving layout's partition, each box written once,
by its lowest-ranked holder. A load describes the loading layout's boxes the same way (a rank
places a replicated box on itself when it holds it), and DCP's own chunk intersection reshards.
Next to the tensors, `liveshard.json` holds the training scalars, the settings, the model and the
layout it was written in; a model from a Hugging Face directory has its config and tokenizer files
copied into `hf/`, so that the checkpoint is self-contained (`liveshard-export` reads them).
This is also the fallback when no live copy of a byte survives.

A save is all or nothing, and the same on every member: the members write into `.NAME.partial`
beside the target directory, and rank 0 renames it into place once every member wrote its part
and `liveshard.json` is in it, so a directory named like a checkpoint is a whole one (a
checkpoint saved again to the same path replaces the old one only then). Any member's failure
(a full disk, no permission, a target that is a file) reaches every member through the gather
that ends each phase (DCP's own, and ours around it), and each raises `CheckpointError` with the
same reason; rank 0 removes the partial directory. A directory without `liveshard.json`, or with
one that cannot be read, is not a checkpoint: `read_metadata` refuses it.

DCP coordinates ranks through torch.distributed's default process group, which training never
uses: a checkpoint creates one (gloo, over the current world's members, from the job's store under
a prefix of its own) for its duration and destroys it afterwards.

Elsewhere, the checkpoint is a plain DCP checkpoint: `torch.distributed.checkpoint.load` fills
any tensors of those names and global shapes (or slices of them), and
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, "full.pt")` turns it into one
`torch.save` file of whole tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from liveshard_core.errors import InvalidInput, RetryableError
from liveshard_core.job import TrainingSettings
from liveshard_core.layout.layout import Layout
from liveshard_core.layout.region import partition
from liveshard_core.vps.box import Box
from liveshard_core.vps.hf import WEIGHTS_INDEX, HfModel
from liveshard_core.vps.spec import ModelSpec, config_to_dict

from ..engine.backend import sharded_tensor
from ..engine.state import TORCH_DTYPES, ShardedState, placements
from .trainer import Scalars

METADATA = "liveshard.json"
HF_FILES = "hf"  # the model directory's config and tokenizer files
DCP_METADATA = ".metadata"  # DCP's own index of the tensors, written by its coordinator


class CheckpointError(RetryableError):
    """A checkpoint that could not be saved or loaded; every member of the world raises it with
    the same reason, and its state is as before. A later checkpoint may succeed."""


def save_state_dict(state: ShardedState) -> dict[str, torch.Tensor]:
    """Every logical tensor, each box saved by its designated (lowest-ranked) holder only."""
    out = {}
    for ref, placed in placements(state.spec, state.layout):
        boxes = [(box, holders[0]) for box, holders in partition(state.layout, placed)]
        out[state.spec.tensor_name(ref)] = _sharded(state, ref, boxes)
    return out


def load_state_dict(state: ShardedState) -> dict[str, torch.Tensor]:
    """Every logical tensor, with every box `state`'s rank holds (replicas included) as a local
    shard: this rank's own metadata places a replicated box on itself when it holds it."""
    out = {}
    rank = state.rank
    for ref, placed in placements(state.spec, state.layout):
        boxes = [
            (box, rank if rank in holders else holders[0])
            for box, holders in partition(state.layout, placed)
        ]
        out[state.spec.tensor_name(ref)] = _sharded(state, ref, boxes)
    return out


def _sharded(state: ShardedState, ref: Any, boxes: list[tuple[Box, int]]) -> torch.Tensor:
    param = state.spec.params[ref.param]
    dtype = TORCH_DTYPES[state.spec.dtype(ref.kind)]
    return sharded_tensor(param.shape, dtype, boxes, dict(state.boxes_of(ref)), state.rank)


class _DefaultGroup:
    """torch.distributed's default group over a world's members, for DCP's coordination only."""

    def __init__(self, store: Store, prefix: str, rank: int, size: int, timeout: float) -> None:
        self.args = (PrefixStore(prefix, store), rank, size, timeout)

    def __enter__(self) -> None:
        store, rank, size, timeout = self.args
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
        )
        # DCP warns on every ShardedTensor; they are what lets it save arbitrary boxes.
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)

    def __exit__(self, *_: object) -> None:
        self.warnings.__exit__(None, None, None)
        dist.destroy_process_group()


def save(
    state: ShardedState,
    scalars: Scalars,
    settings: TrainingSettings,
    directory: str | os.PathLike[str],
    *,
    store: Store,
    prefix: str,
    timeout: float = 300.0,
    hf: HfModel | None = None,
) -> None:
    """Every member of the world calls this at the same step boundary; `prefix` names this
    checkpoint in the job's store (each checkpoint of a job needs its own); `hf` is the model's
    Hugging Face directory, whose config and tokenizer files it records. Raises `CheckpointError`
    on every member alike when any could not save its part; `directory` is then as before."""
    layout = state.layout
    target = Path(directory)
    partial = target.with_name(f".{target.name}.partial")
    first = state.rank == 0
    tensors: dict[str, torch.Tensor] = {}

    def prepare() -> None:
        tensors.update(save_state_dict(state))
        if first:
            _prepare(target, partial)

    with _DefaultGroup(store, prefix, state.rank, layout.world_size, timeout):
        try:
            _agreed("prepare", prepare)
            try:
                writer = FileSystemWriter(partial)
                state_dict_saver.save(tensors, storage_writer=writer)
            except CheckpointException as err:  # raised on every rank, with every rank's error
                raise CheckpointError(f"write: {_reason(err)}") from None
            meta = {
                "scalars": scalars.as_dict(),
                "settings": settings.as_dict(),
                "model": config_to_dict(state.spec.config),
                "model_digest": state.spec.digest,
                "layout": layout.describe(),
                "members": list(layout.members),
            }
            _agreed("finish", lambda: _finish(meta, hf, partial, target) if first else None)
        except CheckpointError as err:
            if first:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(f"checkpoint to {target} failed: {err}") from None


def _agreed(phase: str, action: Callable[[], None]) -> None:
    """Run this rank's part of `phase`, then learn every rank's outcome: all raise
    `CheckpointError` if any failed, so no member goes on while another gave up."""
    try:
        action()
        mine = None
    except Exception as err:  # any: a rank that skipped the gather would leave the others in it
        mine = f"{type(err).__name__}: {err}"
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    failed = [f"rank {rank}: {why}" for rank, why in enumerate(outcomes) if why is not None]
    if failed:
        raise CheckpointError(f"{phase}: {'; '.join(failed)}")


def _prepare(target: Path, partial: Path) -> None:
    """Rank 0, before anyone writes: a target that is not a directory cannot be replaced, and a
    partial directory left by an earlier failure goes."""
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)


def _finish(meta: dict[str, Any], hf: HfModel | None, partial: Path, target: Path) -> None:
    """Rank 0, once every member wrote: the metadata, then the directory into place."""
    (partial / METADATA).write_text(json.dumps(meta, indent=1))
    if hf is not None:
        _record_files(hf, partial / HF_FILES)
    if not target.exists():
        partial.rename(target)
        return
    replaced = target.with_name(f".{target.name}.replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    target.rename(replaced)
    try:
        partial.rename(target)
    except OSError:
        replaced.rename(target)  # the older checkpoint stays whole where it was
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def _reason(err: CheckpointException) -> str:
    """DCP's gathered failures, one line per rank (its traceback stays out)."""
    failures = sorted(err.failures.items())
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in failures)


def _record_files(hf: HfModel, into: Path) -> None:
    into.mkdir(exist_ok=True)
    for path in sorted(hf.directory.iterdir()):
        wanted = path.suffix in (".json", ".txt", ".model", ".jinja")
        if path.is_file() and wanted and path.name != WEIGHTS_INDEX:
            shutil.copyfile(path, into / path.name)


def read_metadata(directory: str | os.PathLike[str], spec: ModelSpec) -> dict[str, Any]:
    """A checkpoint's `liveshard.json`, once it is known to be a whole checkpoint of `spec`'s
    model; `InvalidInput` naming the directory and what is wrong otherwise."""
    path = Path(directory) / METADATA
    if not Path(directory).is_dir():
        raise InvalidInput(f"no liveshard checkpoint at {directory}: not a directory")
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
        digest, model = meta["model_digest"], meta["model"]
        if digest != spec.digest:
            raise InvalidInput(
                f"checkpoint {directory} holds model {model.get('name')!r} (digest {digest}), "
                f"not {spec.config.name!r} (digest {spec.digest})"
            )
        Scalars.from_dict(meta["scalars"])
    except OSError as err:
        raise InvalidInput(
            f"no liveshard checkpoint at {directory}: {METADATA}: {err.strerror}"
        ) from None
    except InvalidInput:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InvalidInput(
            f"checkpoint {directory}: {METADATA} cannot be read: {type(err).__name__}: {err}"
        ) from None
    try:
        FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # a missing file, a truncated or foreign pickle: all say the same
        raise InvalidInput(
            f"checkpoint {directory}: its tensors' index ({DCP_METADATA}) cannot be read: "
            f"{type(err).__name__}: {err}"
        ) from None
    return meta


def load(
    spec: ModelSpec,
    layout: Layout,
    rank: int,
    device: torch.device,
    directory: str | os.PathLike[str],
    *,
    store: Store,
    prefix: str,
    timeout: float = 300.0,
) -> tuple[ShardedState, Scalars]:
    """The rank's state under `layout` (any layout) and the scalars, from a checkpoint; raises
    `CheckpointError` on every member alike when any could not read its part."""
    meta = read_metadata(directory, spec)
    state = ShardedState.allocate(spec, layout, rank, device)
    with _DefaultGroup(store, prefix, rank, layout.world_size, timeout):
        try:
            reader = FileSystemReader(str(directory))
            state_dict_loader.load(load_state_dict(state), storage_reader=reader)
        except CheckpointException as err:  # raised on every rank, with every rank's error
            raise CheckpointError(f"restore from {directory} failed: {_reason(err)}") from None
    return state, Scalars.from_dict(meta["scalars"])
