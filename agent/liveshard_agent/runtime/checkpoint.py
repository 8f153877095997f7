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
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from liveshard_core.errors import InvalidInput
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
    Hugging Face directory, whose config and tokenizer files it records."""
    layout = state.layout
    with _DefaultGroup(store, prefix, state.rank, layout.world_size, timeout):
        state_dict_saver.save(save_state_dict(state), checkpoint_id=str(directory))
        if state.rank == 0:
            meta = {
                "scalars": scalars.as_dict(),
                "settings": settings.as_dict(),
                "model": config_to_dict(state.spec.config),
                "model_digest": state.spec.digest,
                "layout": layout.describe(),
                "members": list(layout.members),
            }
            (Path(directory) / METADATA).write_text(json.dumps(meta, indent=1))
            if hf is not None:
                _record_files(hf, Path(directory) / HF_FILES)
        dist.barrier()  # nobody returns before the metadata is written


def _record_files(hf: HfModel, into: Path) -> None:
    into.mkdir(exist_ok=True)
    for path in sorted(hf.directory.iterdir()):
        wanted = path.suffix in (".json", ".txt", ".model", ".jinja")
        if path.is_file() and wanted and path.name != WEIGHTS_INDEX:
            shutil.copyfile(path, into / path.name)


def read_metadata(directory: str | os.PathLike[str], spec: ModelSpec) -> dict[str, Any]:
    path = Path(directory) / METADATA
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except OSError as err:
        raise InvalidInput(f"no liveshard checkpoint at {directory}: {err.strerror}") from None
    if meta["model_digest"] != spec.digest:
        raise InvalidInput(
            f"checkpoint {directory} holds model {meta['model'].get('name')!r} "
            f"(digest {meta['model_digest']}), not {spec.config.name!r} (digest {spec.digest})"
        )
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
    """The rank's state under `layout` (any layout) and the scalars, from a checkpoint."""
    meta = read_metadata(directory, spec)
    state = ShardedState.allocate(spec, layout, rank, device)
    with _DefaultGroup(store, prefix, rank, layout.world_size, timeout):
        state_dict_loader.load(load_state_dict(state), checkpoint_id=str(directory))
    return state, Scalars.from_dict(meta["scalars"])
