"""The built-in corpus, which needs no download: about 1 MiB of deterministic English-like
sentences over a fixed invented vocabulary (the same on every machine), regular enough that the
loss visibly falls. Pure Python: the tokenizer of the built-in model is trained on it too."""

from __future__ import annotations

import random
from functools import cache

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
