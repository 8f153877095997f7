"""Data benchmark: tokenizing with `prepare`, and reading training windows from the result.

On this machine, with the built-in tokenizer (a byte-level BPE of 512 ids) and the built-in
corpus repeated to about 20 MB of text (2 MB with --quick), written as a jsonl of one document
per corpus line:

- `prepare`: the whole command's work (read the jsonl, `encode_batch_fast` on batches of 1024
  documents, append eos, write the token files, rename into place) in tokens and bytes of text
  per second, best of --repeat runs into a fresh directory each; and `encode_batch_fast` alone on
  the same documents (already in memory), to show what the rest costs. The corpus is repetitive, so
  the tokenizer's word cache hits more than on real text: treat the rates as an upper bound for
  this vocabulary, not a prediction for a 150k-id tokenizer.
- `windows`: a training step's read, a batch of 24 shuffled samples of 1024 tokens
  (`sample_ids` then `windows`, int64 out), over many batches of a warm (page-cached) memory map:
  seconds per batch and tokens per second, for both parts.

    python bench/data_prepare.py [--quick] [--repeat 3] [--out bench/results/data_prepare.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common import best, machine, write_json

from liveshard_agent.data.builtin import builtin_model_dir
from liveshard_agent.data.corpus import builtin_corpus
from liveshard_agent.data.order import sample_count, sample_ids, windows
from liveshard_agent.data.prepare import load_tokenizer, prepare
from liveshard_agent.data.tokens import TokenStream

BATCH, SEQ_LEN = 24, 1024


def write_corpus(path: Path, megabytes: float) -> tuple[list[str], int]:
    """The built-in corpus's lines, repeated to `megabytes` of text, as a jsonl."""
    lines = [line for line in builtin_corpus().decode().splitlines(keepends=True) if line]
    docs: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        docs.extend(lines)
        size += sum(len(line) for line in lines)
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return docs, sum(len(doc.encode()) for doc in docs)


def measure_prepare(work: Path, megabytes: float, repeat: int) -> tuple[dict[str, Any], Path]:
    model = builtin_model_dir()
    source = work / "corpus.jsonl"
    docs, text_bytes = write_corpus(source, megabytes)
    runs = iter(range(repeat))

    def run() -> Path:
        out = work / f"prepared-{next(runs)}"
        return prepare([source], model, out, progress=False)

    out, seconds = best(run, repeat)
    tokens = len(TokenStream.open(out))
    tokenizer = load_tokenizer(model)

    def encode_only() -> None:
        for start in range(0, len(docs), 1024):
            tokenizer.encode_batch_fast(docs[start : start + 1024])

    _, encode_seconds = best(encode_only, repeat)
    return {
        "documents": len(docs),
        "text_bytes": text_bytes,
        "tokens": tokens,
        "prepare_seconds": seconds,
        "prepare_tokens_per_second": tokens / seconds,
        "prepare_text_mb_per_second": text_bytes / seconds / 1e6,
        "encode_seconds": encode_seconds,
        "encode_tokens_per_second": tokens / encode_seconds,
    }, out


def measure_windows(out: Path, batches: int) -> dict[str, Any]:
    stream = TokenStream.open(out)
    n = sample_count(stream, SEQ_LEN)
    windows(stream, sample_ids("shuffled", 0, n, 0, n), SEQ_LEN)  # warm the page cache
    ids_seconds = read_seconds = 0.0
    for step in range(batches):
        start = time.perf_counter()
        ids = sample_ids("shuffled", 0, n, step * BATCH, BATCH)
        middle = time.perf_counter()
        windows(stream, ids, SEQ_LEN)
        end = time.perf_counter()
        ids_seconds += middle - start
        read_seconds += end - middle
    tokens = batches * BATCH * SEQ_LEN
    return {
        "samples": n,
        "batch": [BATCH, SEQ_LEN],
        "batches": batches,
        "sample_ids_seconds_per_batch": ids_seconds / batches,
        "windows_seconds_per_batch": read_seconds / batches,
        "windows_tokens_per_second": tokens / read_seconds,
        "step_read_tokens_per_second": tokens / (ids_seconds + read_seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 MB of text, fewer batches")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="also write the results to this JSON file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="liveshard-bench-data-"))
    try:
        megabytes = 2 if args.quick else 20
        prepared, out = measure_prepare(work, megabytes, args.repeat)
        read = measure_windows(out, 200 if args.quick else 2000)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"prepare": prepared, "windows": read, "machine": machine()}
    print(json.dumps(result, indent=1), flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
