"""Byte-level text data whose order is a function of (seed, global sample index).

Sample `i` of a job is the window of `seq_len + 1` bytes of the corpus starting at a hashed offset
of (seed, i); step `s` trains on samples `s * global_batch ..` in order, cut into micro-batches of
consecutive samples, and data-parallel replica `d` takes the `d`-th contiguous run of them. So the
data cursor is `step * global_batch`, it survives every switch, and no sample is lost or repeated
whatever the layout. The corpus is a file the user names (its bytes), or a built-in one that needs
no download: deterministic English-like sentences, regular enough that the loss visibly falls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from liveshard_core.errors import InvalidInput

from . import rng

_BUILTIN_BYTES = 1 << 20


@cache
def builtin_corpus() -> bytes:
    """About 1 MiB of sentences over a fixed invented vocabulary (the same on every machine)."""
    gen = random.Random(20260101)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = sorted({"".join(gen.choices(syllables, k=gen.randint(1, 3))) for _ in range(600)})
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf-like frequencies
    nouns, verbs = words[: len(words) // 2], words[len(words) // 2 :]
    out: list[str] = []
    size = 0
    while size < _BUILTIN_BYTES:
        subject = " ".join(gen.choices(nouns, weights[: len(nouns)], k=gen.randint(1, 2)))
        verb = gen.choices(verbs, weights[: len(verbs)])[0]
        obj = " ".join(gen.choices(nouns, weights[: len(nouns)], k=gen.randint(1, 3)))
        sentence = f"the {subject} {verb}s the {obj}. "
        if gen.random() < 0.1:
            sentence = sentence.capitalize() + "\n"
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()[:_BUILTIN_BYTES]


def load_corpus(path: str | None) -> torch.Tensor:
    """The corpus as a uint8 tensor: the bytes of `path`, or the built-in corpus."""
    if path is None:
        data = builtin_corpus()
    else:
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise InvalidInput(f"cannot read the data file {path}: {err.strerror}") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class Batch:
    """Samples of one micro-batch: inputs and targets (int64 [samples, seq_len]), and their
    global sample indices."""

    inputs: torch.Tensor
    targets: torch.Tensor
    samples: torch.Tensor


class Dataset:
    """Windows of a corpus, addressed by global sample index."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, seed: int) -> None:
        if corpus.numel() < seq_len + 2:
            raise InvalidInput(
                f"the data has {corpus.numel()} bytes; samples of seq_len={seq_len} need at "
                f"least {seq_len + 2}"
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.key = rng.key("data", seed)
        self._offsets = torch.arange(seq_len + 1)

    def batch(self, first: int, count: int) -> Batch:
        """Samples `first .. first + count - 1`."""
        samples = torch.arange(first, first + count, dtype=torch.int64)
        starts = rng.hashed(self.key, samples) % (self.corpus.numel() - self.seq_len - 1)
        windows = self.corpus[starts.unsqueeze(1) + self._offsets].to(torch.int64)
        return Batch(windows[:, :-1], windows[:, 1:], samples)
