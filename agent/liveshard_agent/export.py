"""`liveshard-export`: a liveshard checkpoint, saved in any layout, as a Hugging Face model
directory.

    liveshard-export --checkpoint CKPT --out OUT [--dtype bf16|fp16|fp32] [--shard-size 5GiB]

A checkpoint of a model that came from a Hugging Face directory carries that directory's config
and tokenizer files in `CKPT/hf/` (see `runtime.checkpoint`). The export reads them back,
checks that they describe the model the checkpoint holds (its digest, the model's name and the
training dtype aside), and writes OUT: those files, `config.json` with `dtype` and `torch_dtype`
set to the output dtype, and the weights as safetensors, as transformers writes them:
`model.safetensors` when they fit in one shard, else `model-0000K-of-0000N.safetensors` with
`model.safetensors.index.json`. Names come from the one table of `liveshard_core.vps.hf`
(`HfModel.sources`): a fused `qkv` or `gate_up` is cut into its parts, a tied embedding is
written once, as `model.embed_tokens.weight`. Tensors are written in the table's order.

Values: each parameter's fp32 master copy when the checkpoint keeps one (bf16 and fp16
parameters), else the parameter itself, cast to the output dtype: `--dtype`, else the `dtype`
(or `torch_dtype`) that `config.json` names, else the checkpoint's parameter dtype. An fp32
export is bit-identical to the checkpoint's master (or fp32 parameter) tensors.

Memory: one logical tensor at a time. Each is read alone from the DCP files
(`torch.distributed.checkpoint.load` of a one-entry state dict, in this process, without a
process group), cut into its parts, cast, and its bytes appended to the shard being written:
every shape and the output dtype are known beforehand, so each shard's safetensors header is
written first and the tensors after it, and no shard is ever held in memory. The peak is at most
about three times the largest logical tensor in its stored dtype (the tensor, DCP's read of one
saved box of it, one cast part) above the interpreter and torch, whatever the shard size
(`bench/export.py` measures under two; docs/export.md).

OUT is written as `OUT.tmp-<pid>` beside it and renamed into place at the end, so a reader never
sees a partial export; OUT must not exist, or be an empty folder. It must not decide anything
about training: it only reads a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import shutil
import struct
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from liveshard_core.cli import parse_bytes
from liveshard_core.errors import InvalidInput
from liveshard_core.vps.hf import WEIGHTS, WEIGHTS_INDEX, HfModel, read_json
from liveshard_core.vps.spec import DType, ModelSpec, Param, config_to_dict

from .engine.state import TORCH_DTYPES
from .runtime.checkpoint import HF_FILES, METADATA

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 2**30
HF_DTYPES = {"float32": DType.FP32, "bfloat16": DType.BF16, "float16": DType.FP16}
_HF_NAMES = {dtype: name for name, dtype in HF_DTYPES.items()}
_SAFETENSORS_DTYPES = {DType.FP32: "F32", DType.BF16: "BF16", DType.FP16: "F16"}

Entry = tuple[str, tuple[int, ...]]  # a Hugging Face tensor: its name and shape


class _Reader(FileSystemReader):
    """DCP's file reader with the checkpoint's metadata read once, not once per tensor."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self.metadata: Metadata = super().read_metadata()
        except (OSError, EOFError) as err:
            raise InvalidInput(
                f"no liveshard checkpoint at {path}: no DCP metadata: {err}"
            ) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint opened for export: its Hugging Face files and the model they describe."""

    directory: Path
    hf: HfModel
    spec: ModelSpec
    reader: _Reader

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Checkpoint:
        path = Path(directory)
        if not (path / METADATA).is_file():
            raise InvalidInput(f"no liveshard checkpoint at {path}: it has no {METADATA}")
        meta = read_json(path / METADATA)
        if not isinstance(meta.get("model"), dict) or "model_digest" not in meta:
            raise InvalidInput(f"{path / METADATA}: no model or model_digest; not a checkpoint")
        if not (path / HF_FILES / "config.json").is_file():
            raise InvalidInput(
                f"checkpoint {path} was not trained from a Hugging Face model directory (it has "
                f"no {HF_FILES}/config.json), so it has no Hugging Face names to export to"
            )
        hf = HfModel.load(path / HF_FILES)
        return cls(path, hf, _model(hf, meta, path), _Reader(path))

    def tensor(self, param: Param) -> torch.Tensor:
        """The whole parameter: its fp32 master copy when the checkpoint keeps one."""
        stored = self.reader.metadata.state_dict_metadata
        name = f"{param.name}:master" if f"{param.name}:master" in stored else param.name
        entry = stored.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise InvalidInput(f"checkpoint {self.directory} has no tensor {name!r}")
        if tuple(entry.size) != param.shape:
            raise InvalidInput(
                f"checkpoint {self.directory}: {name} has shape {tuple(entry.size)}, the model "
                f"gives {param.shape}"
            )
        out = torch.empty(param.shape, dtype=entry.properties.dtype)
        with warnings.catch_warnings():
            # "assuming the intent is to load in a single process": it is.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            state_dict_loader.load({name: out}, storage_reader=self.reader, no_dist=True)
        return out


def _model(hf: HfModel, meta: dict[str, Any], directory: Path) -> ModelSpec:
    """The checkpoint's model as `hf/config.json` describes it, refused unless its digest is the
    checkpoint's. Training named the model after its directory and chose the parameter dtype;
    neither is in config.json, so both are taken from the checkpoint."""
    saved = meta["model"]
    try:
        dtype = DType(saved.get("param_dtype"))
    except ValueError:
        raise InvalidInput(
            f"{directory / METADATA}: model.param_dtype={saved.get('param_dtype')!r} must be one "
            f"of {[d.value for d in DType]}"
        ) from None
    config = dataclasses.replace(hf.config, name=str(saved.get("name")), param_dtype=dtype)
    spec = ModelSpec.from_config(config)
    if spec.digest != meta["model_digest"]:
        ours = config_to_dict(config)
        fields = sorted(k for k in ours.keys() | saved.keys() if ours.get(k) != saved.get(k))
        differ = ", ".join(f"{k}={ours.get(k)!r} (checkpoint: {saved.get(k)!r})" for k in fields)
        raise InvalidInput(
            f"{hf.directory / 'config.json'} does not describe the model that checkpoint "
            f"{directory} holds (digest {spec.digest}, the checkpoint's {meta['model_digest']}): "
            f"{differ or 'same fields, different digest'}"
        )
    return spec


def output_dtype(requested: DType | str | None, hf: HfModel, spec: ModelSpec) -> DType:
    """`requested` (`bf16`, `fp16`, `fp32`); else config.json's `dtype` or `torch_dtype`; else the
    checkpoint's parameter dtype."""
    if isinstance(requested, DType):
        return requested
    if requested is not None:
        try:
            return DType(requested)
        except ValueError:
            valid = [d.value for d in DType]
            raise InvalidInput(f"--dtype {requested!r} must be one of {valid}") from None
    key = "dtype" if hf.raw.get("dtype") is not None else "torch_dtype"
    named = hf.raw.get(key)
    if named is None:
        return spec.config.param_dtype
    if named not in HF_DTYPES:
        raise InvalidInput(
            f"{hf.directory / 'config.json'}: {key}={named!r} is not one of {list(HF_DTYPES)}; "
            "choose the output dtype with --dtype"
        )
    return HF_DTYPES[named]


def entries(checkpoint: Checkpoint) -> list[Entry]:
    """Every Hugging Face tensor the export writes, in order."""
    out = []
    sources = checkpoint.hf.sources(checkpoint.spec)
    for param, parts in zip(checkpoint.spec.params, sources, strict=True):
        for source in parts:
            shape = list(param.shape)
            shape[source.dim] = source.stop - source.start
            out.append((source.name, tuple(shape)))
    return out


def shards(tensors: Sequence[Entry], itemsize: int, shard_bytes: int) -> list[list[Entry]]:
    """`tensors` in order, cut into shards of at most `shard_bytes` (a bigger tensor alone)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for entry in tensors:
        nbytes = prod(entry[1]) * itemsize
        if out[-1] and size + nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return out


def shard_names(count: int) -> list[str]:
    """transformers' file names: one `model.safetensors`, or `model-0000K-of-0000N...`."""
    if count == 1:
        return [WEIGHTS]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


class _ShardWriter:
    """Writes planned shards in order, one tensor at a time: each file's safetensors header
    (its 8-byte little-endian length, then JSON padded with spaces to 8 bytes) first, every
    tensor's little-endian bytes after it, back to back in the header's order."""

    def __init__(self, directory: Path, plan: list[list[Entry]], dtype: DType) -> None:
        if sys.byteorder != "little":
            raise InvalidInput("safetensors files are little-endian; export on such a machine")
        self.directory, self.plan, self.dtype = directory, plan, dtype
        self.names = shard_names(len(plan))
        self.shard, self.index = -1, 0
        self.file: BinaryIO | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.file is None or self.index == len(self.plan[self.shard]):
            self._next()
        assert self.file is not None
        planned = self.plan[self.shard][self.index]
        if (name, tuple(tensor.shape)) != planned:  # a bug, never a user's error
            raise AssertionError(f"writing {name} {tuple(tensor.shape)}, planned {planned}")
        data = tensor.to(TORCH_DTYPES[self.dtype]).contiguous().reshape(-1).view(torch.uint8)
        self.file.write(data.numpy().data)
        self.index += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            log.info("wrote %s (%d tensors)", self.names[self.shard], len(self.plan[self.shard]))

    def _next(self) -> None:
        self.close()
        self.shard, self.index = self.shard + 1, 0
        self.file = open(self.directory / self.names[self.shard], "wb")  # noqa: SIM115
        self.file.write(self._header(self.plan[self.shard]))

    def _header(self, tensors: list[Entry]) -> bytes:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset, code = 0, _SAFETENSORS_DTYPES[self.dtype]
        for name, shape in tensors:
            end = offset + prod(shape) * self.dtype.itemsize
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text


def _write_all(checkpoint: Checkpoint, writer: _ShardWriter) -> None:
    """Every Hugging Face tensor, in order: each logical tensor loaded once, cut, written and
    dropped before the next is loaded."""
    sources = checkpoint.hf.sources(checkpoint.spec)
    for param, parts in zip(checkpoint.spec.params, sources, strict=True):
        whole = checkpoint.tensor(param)
        for source in parts:
            part = whole.narrow(source.dim, source.start, source.stop - source.start)
            writer.write(source.name, part)
        del whole, part  # before the next load, not after it


def export(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: DType | str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write `checkpoint` as the Hugging Face model directory `out`; returns `out`."""
    if shard_bytes < 1:
        raise InvalidInput(f"shard size {shard_bytes} must be at least 1 byte")
    target = Path(out)
    _check_destination(target)
    opened = Checkpoint.open(checkpoint)
    chosen = output_dtype(dtype, opened.hf, opened.spec)
    plan = shards(entries(opened), chosen.itemsize, shard_bytes)
    scratch = target.parent / f"{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        _copy_files(opened.hf, scratch, chosen)
        writer = _ShardWriter(scratch, plan, chosen)
        try:
            _write_all(opened, writer)
        finally:
            writer.close()
        if len(plan) > 1:
            _write_index(scratch / WEIGHTS_INDEX, plan, writer.names, chosen)
        _install(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _check_destination(target: Path) -> None:
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise InvalidInput(f"--out {target}: exists and is not an empty folder; name a new one")


def _copy_files(hf: HfModel, into: Path, dtype: DType) -> None:
    """Every file of the checkpoint's `hf/`, with config.json's dtype set to the output's."""
    for path in sorted(hf.directory.iterdir()):
        if path.is_file():
            shutil.copyfile(path, into / path.name)
    name = _HF_NAMES[dtype]
    config = hf.raw | {"dtype": name, "torch_dtype": name}
    (into / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_index(path: Path, plan: list[list[Entry]], names: list[str], dtype: DType) -> None:
    weight_map = {name: file for file, shard in zip(names, plan, strict=True) for name, _ in shard}
    total = sum(prod(shape) for shard in plan for _, shape in shard) * dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _install(scratch: Path, target: Path) -> None:
    try:
        os.replace(scratch, target)  # target absent, or an empty folder
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InvalidInput(f"--out {target}: was filled during the export") from None
        raise InvalidInput(f"{target}: cannot rename into place: {err.strerror}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liveshard-export",
        description="Write a liveshard checkpoint of a Hugging Face model as a Hugging Face "
        "model directory (config, tokenizer files and safetensors weights).",
    )
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (DIR/step-N)")
    parser.add_argument("--out", required=True, help="the model directory to write (new)")
    parser.add_argument(
        "--dtype",
        choices=[d.value for d in DType],
        help="weights dtype (default: config.json's dtype, else the checkpoint's)",
    )
    parser.add_argument(
        "--shard-size", default="5GiB", help="bytes per safetensors file (default 5GiB)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="liveshard-export: %(message)s")
    start = time.perf_counter()
    try:
        shard_bytes = parse_bytes(args.shard_size, "--shard-size")
        out = export(args.checkpoint, args.out, args.dtype, shard_bytes)
    except InvalidInput as err:
        print(f"liveshard-export: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    files = sorted(out.glob("*.safetensors"))
    size = sum(path.stat().st_size for path in files)
    seconds = time.perf_counter() - start
    print(f"{out}: {len(files)} safetensors file(s), {size} bytes, in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
