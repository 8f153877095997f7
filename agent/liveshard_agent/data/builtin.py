"""The built-in default model directory and its tokenized corpus, made locally because nothing
can be downloaded.

`builtin_model_dir` is a tiny Qwen3-architecture Hugging Face model directory without weights:
`config.json`, a byte-level BPE `tokenizer.json` of 512 ids trained on the built-in corpus
(`liveshard_agent.data.corpus.builtin_corpus`), `tokenizer_config.json` and
`generation_config.json`. `builtin_tokens` is that corpus (one document) prepared with that
tokenizer. The core's preset `qwen3-tiny` is this model's shape: a job of that preset
(`job_model`) trains it with its tokenizer, so a cluster job needs no files to name. Both live
under `$LIVESHARD_CACHE/models` (default `~/.cache/liveshard/models`), named
by a hash of what they are made from (the recipe below, the corpus generator's source, the
tokenizers and Python versions), so a change to any of it makes new ones; each is made once, in a
temporary directory renamed into place, so processes that race agree on one. Training is
single-threaded with fixed settings, so the same inputs give a byte-identical `tokenizer.json`.
Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from liveshard_core.job import JobConfig
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.presets import CONFIGS

from .corpus import builtin_corpus
from .prepare import prepare

PRESET = "qwen3-tiny"
EOS = "<|endoftext|>"
VOCAB_SIZE = 512
RECIPE_VERSION = 1

# The model's shape; the token ids are filled in from the tokenizer.
CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "use_sliding_window": False,
}

TRAINER: dict[str, Any] = {"min_frequency": 2, "max_token_length": 16}

_CORPUS_MODULE = "liveshard_agent.data.corpus"


def cache_root() -> Path:
    """`$LIVESHARD_CACHE/models`, or `~/.cache/liveshard/models`."""
    base = os.environ.get("LIVESHARD_CACHE") or Path.home() / ".cache" / "liveshard"
    return Path(base) / "models"


@cache
def builtin_model_dir() -> Path:
    """The built-in tiny Qwen3 model directory (made on first use)."""
    return _made(cache_root() / f"qwen3-tiny-{_digest()}", _write_model)


def job_model(config: JobConfig) -> HfModel | None:
    """The Hugging Face directory a job's model comes from: its model path, or the built-in
    directory when the model is the `qwen3-tiny` preset."""
    if config.hf_model is not None:
        return config.hf_model
    return HfModel.load(builtin_model_dir()) if config.model == CONFIGS[PRESET] else None


@cache
def builtin_corpus_file() -> Path:
    """The built-in corpus as a text file (one document; made on first use)."""
    model = builtin_model_dir()

    def write_corpus(directory: Path) -> None:
        (directory / "corpus.txt").write_text(_corpus_text())

    return _made(model.with_name(model.name + ".corpus"), write_corpus) / "corpus.txt"


@cache
def builtin_tokens() -> Path:
    """The built-in corpus prepared with the built-in tokenizer (made on first use)."""
    model = builtin_model_dir()
    out = model.with_name(model.name + ".tokens")
    return prepare([builtin_corpus_file()], model, out, progress=False)


def _corpus_text() -> str:
    return builtin_corpus().decode("utf-8")


def _digest() -> str:
    """12 hex of a sha256 over the recipe. The corpus enters as the source of the module that
    generates it (and the Python version its `random` comes from), so that finding an existing
    directory needs neither torch nor the second it takes to generate the corpus."""
    spec = importlib.util.find_spec(_CORPUS_MODULE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"cannot find {_CORPUS_MODULE}, which makes the built-in corpus")
    recipe = {
        "version": RECIPE_VERSION,
        "config": CONFIG,
        "trainer": TRAINER,
        "eos": EOS,
        "tokenizers": tokenizers.__version__,
        "python": list(sys.version_info[:2]),
        "corpus": hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _made(directory: Path, write: Callable[[Path], None]) -> Path:
    """`directory`, written by `write` into a temporary sibling renamed into place unless it
    exists already (a racing process's rename may win: then its directory is kept)."""
    if directory.is_dir():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    scratch.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
    try:
        write(scratch)
        try:
            os.replace(scratch, directory)
        except OSError:
            if not directory.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def _write_model(directory: Path) -> None:
    tokenizer = train_tokenizer(_corpus_text())
    eos = tokenizer.token_to_id(EOS)
    config = {**CONFIG, "bos_token_id": eos, "eos_token_id": eos}
    _write_json(directory / "config.json", config)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(directory / "generation_config.json", {"bos_token_id": eos, "eos_token_id": eos})


def train_tokenizer(text: str) -> Tokenizer:
    """A byte-level BPE of `VOCAB_SIZE` ids (`EOS` first) trained on `text`'s lines."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        **TRAINER,
    )
    lines = text.splitlines(keepends=True)
    with _single_threaded():
        tokenizer.train_from_iterator(lines, trainer, length=len(lines))
    return tokenizer


@contextmanager
def _single_threaded() -> Iterator[None]:
    """The tokenizers library reads TOKENIZERS_PARALLELISM on each parallel call."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
