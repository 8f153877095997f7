"""`liveshard-export`: checkpoints of real training runs, exported, load into transformers.

Tiny random models (created and saved by transformers, norms and biases moved off their initial
values so that a wrong mapping shows) are trained for 2 steps by `liveshard-local` (2 processes
each), which saves a checkpoint after every step. The export of the checkpoint after step 0
loads into transformers with no missing or unexpected keys and computes the loss liveshard
reported at step 1 (fp32, 1e-5 relative); its fp32 tensors are the checkpoint's master (or fp32
parameter) tensors bit for bit, cut by the Hugging Face names; one file or many shards hold the
same tensors; and what cannot be exported exits 2 naming the problem.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the export needs torch (the agent extra)")

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from liveshard_agent.export import main
from liveshard_agent.runtime.data import Dataset, load_corpus
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.spec import ModelSpec
from tests.agent.runtime import hf_models

BIN = Path(sys.executable).parent
TRAINING = ["--steps", "2", "--global-batch", "8", "--micro-batch", "2", "--seq-len", "32"]
# name: (family, layout, precision); each run starts 2 worker processes.
RUNS = {
    "qwen3": ("qwen3", "tp=2", "fp32"),  # tied embeddings, q/k norms, head_dim != hidden/heads
    "qwen2": ("qwen2", "tp=2", "bf16"),  # q/k/v biases; bf16 parameters with an fp32 master
    "mixtral": ("mixtral", "dp=2,ep=2", "fp32"),  # experts and router
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Any]]]:
    """Per run: its checkpoint directory (step-1, step-2) and its JSON lines. The runs go at
    once, since each spends most of its time starting processes."""
    root = tmp_path_factory.mktemp("trained")
    started = {}
    for name, (family, layout, precision) in RUNS.items():
        model = hf_models.make_model(family, root / f"{name}-model")
        command = [str(BIN / "liveshard-local"), "--model", str(model), "--nprocs", "2",
                   "--layout", layout, "--precision", precision, *TRAINING, "--checkpoint-dir",
                   str(root / name), "--checkpoint-every", "1", "--json"]  # fmt: skip
        started[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()[-3000:]
        out[name] = (root / name, [json.loads(line) for line in stdout.splitlines()])
    return out


def export(tmp_path: Path, checkpoint: Path, *options: str) -> Path:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    assert main(["--checkpoint", str(checkpoint), "--out", str(out), *options]) == 0
    return out


def step_loss(events: list[Any], step: int) -> float:
    (loss,) = [e["loss"] for e in events if e["event"] == "step" and e["step"] == step]
    return float(loss)


def transformers_loss(directory: Path) -> float:
    """transformers' loss, in fp32, on step 1's batch: samples 8..15."""
    model, info = hf_models.transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = Dataset(load_corpus(None), 32, seed=0).batch(8, 8)
    with torch.no_grad():
        return hf_models.loss(model, batch.inputs, batch.targets).item()


def checkpoint_tensors(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, read by DCP's own converter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(checkpoint, tmp_path / "whole.pt")
    tensors: dict[str, torch.Tensor] = torch.load(tmp_path / "whole.pt")
    return tensors


def exported_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def header_order(path: Path) -> list[str]:
    """The tensors of a safetensors file in the order their bytes lie."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_the_export_computes_the_loss_liveshard_reported(
    trained: dict[str, tuple[Path, list[Any]]], tmp_path: Path, name: str
) -> None:
    checkpoint, events = trained[name]
    out = export(tmp_path, checkpoint / "step-1", "--dtype", "fp32")
    assert transformers_loss(out) == pytest.approx(step_loss(events, 1), rel=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert (out / "generation_config.json").exists()  # every file of hf/ is copied


def test_one_file_and_many_shards_hold_the_same_tensors_in_the_tables_order(
    trained: dict[str, tuple[Path, list[Any]]], tmp_path: Path
) -> None:
    checkpoint = trained["qwen3"][0] / "step-2"
    one = export(tmp_path, checkpoint)
    many = export(tmp_path, checkpoint, "--shard-size", "100KB")
    assert sorted(p.name for p in one.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in many.glob("*.safetensors")) == files
    assert all((many / f).stat().st_size <= 100_000 + 4096 for f in files)  # header aside

    hf = HfModel.load(checkpoint / "hf")
    spec = ModelSpec.from_config(hf.config)
    order = [source.name for sources in hf.sources(spec) for source in sources]
    assert header_order(one / "model.safetensors") == order
    assert [n for f in files for n in header_order(many / f)] == order
    assert "lm_head.weight" not in order  # tied: the embedding only

    a, b = exported_tensors(one), exported_tensors(many)
    assert a.keys() == b.keys() == set(order)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    first = hf_models.load(one).state_dict()
    second = hf_models.load(many).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_fp32_export_is_the_master_bit_for_bit_and_bf16_the_parameter(
    trained: dict[str, tuple[Path, list[Any]]], tmp_path: Path
) -> None:
    checkpoint = trained["qwen2"][0] / "step-2"
    stored = checkpoint_tensors(checkpoint, tmp_path)
    hf = HfModel.load(checkpoint / "hf")
    spec = ModelSpec.from_config(hf.config)
    fp32 = exported_tensors(export(tmp_path, checkpoint, "--dtype", "fp32"))
    bf16 = exported_tensors(export(tmp_path, checkpoint, "--dtype", "bf16"))
    default = export(tmp_path, checkpoint)  # config.json says float32
    assert json.loads((default / "config.json").read_text())["dtype"] == "float32"
    names = set()
    for param, sources in zip(spec.params, hf.sources(spec), strict=True):
        master, value = stored[f"{param.name}:master"], stored[param.name]
        assert master.dtype == torch.float32 and value.dtype == torch.bfloat16
        for source in sources:
            width = source.stop - source.start
            assert torch.equal(fp32[source.name], master.narrow(source.dim, source.start, width))
            assert torch.equal(bf16[source.name], value.narrow(source.dim, source.start, width))
            names.add(source.name)
    assert names == fp32.keys() == bf16.keys()
    assert any(name.endswith("q_proj.bias") for name in names)
    assert transformers_loss(default) > 0  # and transformers loads it


def test_what_cannot_be_exported_exits_2_naming_the_problem(
    trained: dict[str, tuple[Path, list[Any]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checkpoint = trained["qwen3"][0] / "step-1"

    def refused(source: Path, *options: str) -> str:
        out = tmp_path / "out"
        assert main(["--checkpoint", str(source), "--out", str(out), *options]) == 2
        assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
        return capsys.readouterr().err

    assert "no liveshard checkpoint at" in refused(tmp_path)
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    shutil.rmtree(bare / "hf")  # as a preset's checkpoint is
    assert "was not trained from a Hugging Face model directory" in refused(bare)
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "hf" / "config.json").read_text())
    (other / "hf" / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    assert "ffn=128 (checkpoint: 96)" in refused(other)
    assert "--shard-size" in refused(checkpoint, "--shard-size", "lots")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("")
    result = subprocess.run(
        [str(BIN / "liveshard-export"), "--checkpoint", str(checkpoint), "--out",
         str(tmp_path / "out")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("liveshard-export: --out") and "not an empty folder" in (
        result.stderr
    )
    assert (tmp_path / "out" / "keep").exists()


# A member that loads a Hugging Face directory and saves a checkpoint before any step: a world
# of one, in its own process (its process groups are the default's).
_LOAD_AND_SAVE = """
import sys, torch
from torch.distributed import HashStore
from liveshard_agent.runtime.member import Member
from liveshard_core.job import JobConfig, TrainingSettings
from liveshard_core.layout.layout import Degrees
from liveshard_core.vps.hf import HfModel
directory, checkpoint, precision = sys.argv[1:]
config = JobConfig(
    model=HfModel.load(directory).config, model_path=directory, precision=precision,
    training=TrainingSettings(global_batch=1, micro_batch=1, seq_len=8, steps=1),
)
spec = config.model_spec("cpu")
member = Member(name="m0", spec=spec, settings=config.training, device=torch.device("cpu"),
                store=HashStore(), hf=config.hf_model, pretrained=True)
member.start(Degrees(dp=1).layout(spec, ["m0"]))
member.checkpoint(checkpoint)
"""


@pytest.mark.parametrize(("family", "precision"), [("qwen3", "fp32"), ("mixtral", "bf16")])
def test_load_then_export_without_training_gives_back_the_input_tensors_bit_for_bit(
    tmp_path: Path, family: str, precision: str
) -> None:
    """In bf16 the fp32 master copy keeps the input's bits, so an fp32 export gives them back."""
    model = hf_models.make_model(family, tmp_path / "model")
    checkpoint = tmp_path / "checkpoint"
    run = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_SAVE, str(model), str(checkpoint), precision],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = export(tmp_path, checkpoint, "--dtype", "fp32")
    given, got = load_file(model / "model.safetensors"), exported_tensors(out)
    assert given.keys() == got.keys()
    for name, tensor in given.items():
        assert tensor.dtype == got[name].dtype == torch.float32
        assert torch.equal(tensor.view(torch.int32), got[name].view(torch.int32)), name
