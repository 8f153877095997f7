"""Training data: windows of a token stream, in an order that is a function of (seed, global sample
index) only.

The stream is a prepared token directory (`liveshard_agent.data`: text tokenized once with the
job's tokenizer), or, for a model without a tokenizer, the bytes of a text. Sample `j` is the
stream's tokens `[j*S, j*S + S]` (S = seq_len); global sample `i` trains on sample
`order.sample_ids(data_order, seed, n, i)` (sequential, or a permutation of each epoch that the
seed fixes). Step `s` trains on samples `s * global_batch ..` in order, cut into micro-batches of
consecutive samples, and data-parallel replica `d` takes the `d`-th contiguous run of them. So the
data cursor is `step * global_batch`: it survives every switch, and no sample is lost or repeated
whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from liveshard_core.errors import InvalidInput
from liveshard_core.job import TrainingSettings

from ..data import order
from ..data.builtin import builtin_corpus_file
from ..data.corpus import builtin_corpus
from ..data.prepare import resolve_data

_BYTES = 256


@dataclass(frozen=True)
class ByteText:
    """The bytes of a text as its tokens (a byte-level model's stream)."""

    tokens: np.ndarray
    directory: str  # what errors name

    def __len__(self) -> int:
        return len(self.tokens)


def load_corpus(path: str | None) -> ByteText:
    """The bytes of the file `path`, or of the built-in corpus."""
    if path is None:
        return ByteText(np.frombuffer(builtin_corpus(), dtype=np.uint8), "the built-in corpus")
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise InvalidInput(f"cannot read the data file {path}: {err.strerror}") from None
    return ByteText(np.frombuffer(data, dtype=np.uint8), path)


def open_data(settings: TrainingSettings, tokenizer: Path | None, vocab: int) -> order.Tokens:
    """The job's token stream: `settings.data` (or the built-in corpus) tokenized with
    `tokenizer`, or its bytes when there is none; every id below the model's `vocab`."""
    if tokenizer is None:
        if vocab < _BYTES:
            raise InvalidInput(
                f"the model's vocabulary has {vocab} ids: byte-level text needs {_BYTES}; give a "
                "tokenizer"
            )
        return load_corpus(settings.data)
    stream = resolve_data([settings.data or builtin_corpus_file()], tokenizer)
    stream.check_vocab(vocab)
    return stream


def job_dataset(settings: TrainingSettings, tokenizer: Path | None, vocab: int) -> Dataset:
    """The job's samples (see `open_data`); a corpus shorter than one step is refused."""
    stream = open_data(settings, tokenizer, vocab)
    data = Dataset(stream, settings.seq_len, settings.seed, settings.data_order)
    if data.samples < settings.global_batch:
        raise InvalidInput(
            f"{stream.directory}: corpus shorter than one step: {data.samples} samples of "
            f"seq_len={settings.seq_len}, and a step trains on {settings.global_batch}"
        )
    return data


def tokenizer_of(settings: TrainingSettings, model_dir: Path | None) -> Path | None:
    """The job's tokenizer: the one named, else the model directory's, else none (bytes)."""
    if settings.tokenizer is not None:
        return Path(settings.tokenizer)
    if model_dir is not None and (model_dir / "tokenizer.json").exists():
        return model_dir / "tokenizer.json"
    return None


@dataclass(frozen=True)
class Batch:
    """Samples of one micro-batch: inputs and targets (int64 [samples, seq_len]), and their
    global sample indices."""

    inputs: torch.Tensor
    targets: torch.Tensor
    samples: torch.Tensor


class Dataset:
    """Windows of a token stream, addressed by global sample index."""

    def __init__(
        self, stream: order.Tokens, seq_len: int, seed: int, data_order: str = "shuffled"
    ) -> None:
        self.stream, self.seq_len, self.seed, self.order = stream, seq_len, seed, data_order
        self.samples = order.sample_count(stream, seq_len)

    def batch(self, first: int, count: int, device: torch.device | None = None) -> Batch:
        """Samples `first .. first + count - 1`, their tokens on `device` (the host's by
        default; the sample indices stay there)."""
        ids = order.sample_ids(self.order, self.seed, self.samples, first, count)
        windows = torch.from_numpy(order.windows(self.stream, ids, self.seq_len)).to(device)
        samples = torch.arange(first, first + count, dtype=torch.int64)
        return Batch(windows[:, :-1], windows[:, 1:], samples)
