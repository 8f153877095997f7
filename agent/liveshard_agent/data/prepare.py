"""Tokenizing text inputs once into a prepared directory: `liveshard-data prepare`, and the cache
the trainer uses when it is given text.

A document's tokens are `tokenizer.encode(text).ids` (computed with `encode_batch_fast` on
batches of documents) followed by the eos id; documents are concatenated in input order (see
`sources`) into one stream, written in the format of `tokens`.
The tokenizer is a Hugging Face `tokenizer.json` (or a folder holding one); the eos id is
`--eos-id`, else `eos_token_id` of the `config.json` beside the tokenizer (the first, if a list).

A directory is written under a hidden temporary name beside its destination and renamed into
place, so a reader never sees a partial one; a destination that already holds the same
preparation (same input files, sizes and modification times, tokenizer, field and eos: its
`fingerprint`) is reused without tokenizing. `cached` keeps such a directory beside the first
input, named by that fingerprint, so several processes may race to make it: each writes its own
temporary directory, one rename wins, the others reuse the winner's.

    liveshard-data prepare --tokenizer T --out DIR [--field F] [--eos-id N] INPUT...
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from itertools import chain, islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm  # type: ignore[import-untyped]

from liveshard_core.errors import InvalidInput

from .sources import DEFAULT_FIELD, file_documents, input_files
from .tokens import FORMAT_VERSION, TokenIndex, TokenStream, TokenWriter

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
CACHE_MARK = ".liveshard-tokens-"


def tokenizer_file(path: str | Path) -> Path:
    """The `tokenizer.json` that `path` names: the file itself, or the one in a folder."""
    given = Path(path)
    found = given / TOKENIZER_FILE if given.is_dir() else given
    if not found.is_file():
        raise InvalidInput(
            f"--tokenizer {given}: no such file; name a tokenizer.json or a folder holding one"
        )
    return found


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer that `path` names."""
    found = tokenizer_file(path)
    try:
        return Tokenizer.from_str(found.read_bytes().decode("utf-8"))
    except Exception as err:  # the Rust side raises plain Exceptions
        raise InvalidInput(f"{found}: not a tokenizers tokenizer.json: {err}") from None


def tokenizer_sha256(path: str | Path) -> str:
    """The sha256 (hex) of the `tokenizer.json` that `path` names: what identifies a tokenizer
    in a preparation's fingerprint, without parsing it."""
    return hashlib.sha256(tokenizer_file(path).read_bytes()).hexdigest()


def eos_token_id(tokenizer_path: str | Path, eos_id: int | None = None) -> int:
    """`eos_id` when given, else `eos_token_id` of the `config.json` beside the tokenizer."""
    if eos_id is not None:
        return eos_id
    config = tokenizer_file(tokenizer_path).parent / CONFIG_FILE
    hint = "; give --eos-id"
    if not config.is_file():
        raise InvalidInput(f"no eos token id: {config} does not exist{hint}")
    try:
        value = json.loads(config.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise InvalidInput(f"{config}: not a JSON object: {err}{hint}") from None
    if isinstance(value, list) and value:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"{config}: eos_token_id is {value!r}, not a token id{hint}")
    return value


def fingerprint(files: Sequence[Path], tokenizer_sha256: str, field: str, eos: int) -> str:
    """The sha256 (hex) of what a preparation depends on: the input files (absolute paths,
    sizes, modification times in ns), the tokenizer's sha256, the field, the eos id."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    recipe = {
        "format": FORMAT_VERSION,
        "files": stats,
        "tokenizer": tokenizer_sha256,
        "field": field,
        "eos": eos,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def prepare(
    inputs: Sequence[str | Path],
    tokenizer_path: str | Path,
    out: str | Path,
    field: str = DEFAULT_FIELD,
    eos_id: int | None = None,
    batch_docs: int = 1024,
    progress: bool = True,
) -> Path:
    """Tokenize `inputs` into the prepared directory `out` (see the module docstring) and return
    its path; an `out` that already holds the same preparation is returned as it is."""
    if batch_docs < 1:
        raise InvalidInput(f"batch_docs={batch_docs}: must be at least 1")
    target = Path(out).absolute()
    files = input_files(inputs)
    sha = tokenizer_sha256(tokenizer_path)
    eos = eos_token_id(tokenizer_path, eos_id)
    key = fingerprint(files, sha, field, eos)
    if _reusable(target, key):
        return target
    _check_destination(target)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 0 <= eos < vocab:
        raise InvalidInput(f"eos token id {eos}: not in the tokenizer's vocabulary [0, {vocab})")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        scratch.chmod(0o755)  # mkdtemp's 0700 would hide the data from other users
    except OSError as err:
        raise InvalidInput(f"{target}: cannot write beside it: {err.strerror}") from None
    try:
        writer = TokenWriter(scratch, vocab)
        try:
            _tokenize(tokenizer, files, field, eos, writer, batch_docs, progress)
            writer.finish(
                eos_token_id=eos,
                tokenizer_sha256=sha,
                sources=tuple(str(Path(p).absolute()) for p in inputs),
                field=field,
                fingerprint=key,
            )
        except BaseException:
            writer.abandon()
            raise
        return _install(scratch, target, key)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cached(
    inputs: Sequence[str | Path],
    tokenizer_path: str | Path,
    field: str = DEFAULT_FIELD,
    eos_id: int | None = None,
    progress: bool = True,
) -> Path:
    """The prepared directory of `inputs`, tokenized on first use into a hidden cache directory
    beside the first input: `.<first input's name>.liveshard-tokens-<12 hex of fingerprint>`."""
    files = input_files(inputs)
    eos = eos_token_id(tokenizer_path, eos_id)
    first = Path(inputs[0]).resolve()
    key = fingerprint(files, tokenizer_sha256(tokenizer_path), field, eos)
    out = first.parent / f".{first.name}{CACHE_MARK}{key[:12]}"
    return prepare(inputs, tokenizer_path, out, field, eos, progress=progress)


def resolve_data(
    paths: Sequence[str | Path], tokenizer_path: str | Path, field: str = DEFAULT_FIELD
) -> TokenStream:
    """The token stream of a job's data: one prepared directory as it is, else text inputs
    through `cached`."""
    if isinstance(paths, str | Path):
        paths = [paths]
    if len(paths) == 1 and TokenStream.is_prepared(paths[0]):
        stream = TokenStream.open(paths[0])
        sha = tokenizer_sha256(tokenizer_path)
        if stream.index.tokenizer_sha256 != sha:
            log.warning(
                "%s was prepared with another tokenizer than %s (sha256 %s, not %s)",
                paths[0],
                tokenizer_file(tokenizer_path),
                stream.index.tokenizer_sha256[:12],
                sha[:12],
            )
        return stream
    return TokenStream.open(cached(paths, tokenizer_path, field))


def _tokenize(
    tokenizer: Tokenizer,
    files: Sequence[Path],
    field: str,
    eos: int,
    writer: TokenWriter,
    batch_docs: int,
    progress: bool,
) -> None:
    docs: Iterator[str] = chain.from_iterable(file_documents(p, field) for p in files)
    show = progress and sys.stderr.isatty()
    with tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, disable=not show) as bar:
        while batch := list(islice(docs, batch_docs)):
            # On every core (the Rust side releases the GIL); `_fast` skips the offsets, which
            # are not kept, and gives the same ids as `encode` (about a quarter faster).
            ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(batch)]
            lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(
                chain.from_iterable(chain(x, (eos,)) for x in ids),
                dtype=np.uint32,
                count=int(lengths.sum()),
            )
            writer.append(flat, lengths)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{writer.tokens:,}", refresh=False)


def _reusable(target: Path, key: str) -> bool:
    if not TokenStream.is_prepared(target):
        return False
    try:
        index = TokenIndex.from_json(target / "index.json")
        if index.fingerprint != key:
            return False
        TokenStream.open(target)
    except (InvalidInput, OSError):
        return False
    return True


def _check_destination(target: Path) -> None:
    """Refuse to replace anything but a prepared directory or an empty folder."""
    if not target.exists() or TokenStream.is_prepared(target):
        return
    if target.is_dir() and not any(target.iterdir()):
        return
    raise InvalidInput(
        f"--out {target}: exists and is not a prepared data directory; name a new folder"
    )


def _install(scratch: Path, target: Path, key: str) -> Path:
    """Rename the finished `scratch` to `target`, or reuse a `target` a racing process made."""
    try:
        os.replace(scratch, target)  # target absent, or an empty folder
        return target
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise InvalidInput(f"{target}: cannot rename into place: {err.strerror}") from None
    if _reusable(target, key):
        return target
    # A stale preparation (other inputs): move it aside, then put the new one in its place.
    stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, stale / "old")
    try:
        os.replace(scratch, target)
    finally:
        shutil.rmtree(stale, ignore_errors=True)
    return target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liveshard-data", description="Tokenize training data once, for liveshard jobs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "prepare",
        help="tokenize text inputs into a prepared directory",
        description="Tokenize jsonl, parquet and text files (or folders of them), in the order "
        "given, into a prepared directory of memory-mapped tokens.",
    )
    run.add_argument("inputs", nargs="+", metavar="INPUT", help="a file or a folder")
    run.add_argument("--tokenizer", required=True, help="a tokenizer.json or a folder with one")
    run.add_argument("--out", required=True, help="the prepared directory to write")
    run.add_argument("--field", default=DEFAULT_FIELD, help="jsonl field / parquet column")
    run.add_argument("--eos-id", type=int, help="the eos id (default: from config.json)")
    run.add_argument("--batch-docs", type=int, default=1024, help="documents per encode batch")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            field=args.field,
            eos_id=args.eos_id,
            batch_docs=args.batch_docs,
            progress=not args.no_progress,
        )
        index = TokenStream.open(out).index
    except InvalidInput as err:
        print(f"liveshard-data: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    seconds = time.perf_counter() - start
    print(
        f"{out}: {index.tokens} tokens in {index.documents} documents ({index.dtype}, vocab "
        f"{index.vocab_size}, eos {index.eos_token_id}) in {seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
