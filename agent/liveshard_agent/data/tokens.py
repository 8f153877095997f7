"""The prepared-data format on disk, its writer and its reader.

A prepared directory holds three files:

- `tokens.bin`: every document's token ids (the document's tokens, then eos), concatenated in
  input order, as raw little-endian `uint16` when the vocabulary has at most 65536 ids, else
  `uint32`;
- `documents.npy`: `int64` offsets into the stream, one per document plus one (`D + 1` entries,
  `0` first and the token count last): document `k` is `tokens[offsets[k]:offsets[k + 1]]`;
- `index.json`: what the other two hold and how they were made (see `TokenIndex`), written last.

`TokenStream.open` memory-maps a directory and checks that the files agree with `index.json`, so
a reader never trains on a truncated or foreign file. The writer (`TokenWriter`) fills a directory
that `prepare` then renames into place; this module knows nothing of tokenizers or inputs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from liveshard_core.errors import InvalidInput

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.npy"
INDEX_FILE = "index.json"

_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype for ids below `vocab_size`."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class TokenIndex:
    """The contents of `index.json`.

    `fingerprint` identifies what was tokenized (see `prepare.fingerprint`: the input files with
    their sizes and modification times, the tokenizer's sha256, the field and eos), so a directory
    is reused only for the same inputs. `max_token` is the largest id in the stream, computed once
    while writing, so checking it against a model's vocabulary reads no tokens.
    """

    format_version: int
    dtype: str
    tokens: int
    documents: int
    vocab_size: int
    eos_token_id: int
    tokenizer_sha256: str
    sources: tuple[str, ...]
    field: str
    max_token: int
    fingerprint: str

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "sources": list(self.sources)}, indent=1) + "\n"

    @staticmethod
    def from_json(path: Path) -> TokenIndex:
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise InvalidInput(f"{path}: cannot read it: {err.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InvalidInput(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise InvalidInput(f"{path}: expected a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise InvalidInput(
                f"{path}: format_version {version!r} is not supported (this reader knows "
                f"{FORMAT_VERSION}); prepare the data again"
            )
        names = [f.name for f in fields(TokenIndex)]
        missing = [name for name in names if name not in data]
        if missing:
            raise InvalidInput(f"{path}: missing fields {missing}")
        values: dict[str, Any] = {name: data[name] for name in names}
        values["sources"] = tuple(values["sources"])
        if values["dtype"] not in _DTYPES:
            raise InvalidInput(f"{path}: dtype {values['dtype']!r} is not one of {sorted(_DTYPES)}")
        return TokenIndex(**values)


class TokenWriter:
    """Appends documents' tokens to a new directory's `tokens.bin`, then writes the offsets and
    `index.json` (`finish`). The directory is expected to be a private temporary one."""

    def __init__(self, directory: Path, vocab_size: int) -> None:
        self.directory = directory
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.tokens = 0
        self.max_token = -1
        self._ends: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._file: BinaryIO = (directory / TOKENS_FILE).open("wb")

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Add documents: `tokens` their ids concatenated, `lengths` each one's token count."""
        if tokens.size:
            self.max_token = max(self.max_token, int(tokens.max()))
        self._file.write(np.ascontiguousarray(tokens, dtype=_DTYPES[self.dtype]).tobytes())
        self._ends.append(self.tokens + np.cumsum(lengths, dtype=np.int64))
        self.tokens += int(tokens.size)

    def finish(
        self,
        *,
        eos_token_id: int,
        tokenizer_sha256: str,
        sources: tuple[str, ...],
        field: str,
        fingerprint: str,
    ) -> TokenIndex:
        self._file.close()
        offsets = np.concatenate(self._ends)
        np.save(self.directory / DOCUMENTS_FILE, offsets)
        index = TokenIndex(
            format_version=FORMAT_VERSION,
            dtype=self.dtype,
            tokens=self.tokens,
            documents=len(offsets) - 1,
            vocab_size=self.vocab_size,
            eos_token_id=eos_token_id,
            tokenizer_sha256=tokenizer_sha256,
            sources=sources,
            field=field,
            max_token=self.max_token,
            fingerprint=fingerprint,
        )
        (self.directory / INDEX_FILE).write_text(index.to_json())
        return index

    def abandon(self) -> None:
        self._file.close()


class TokenStream:
    """A prepared directory, memory-mapped: `tokens` (1-D, the stored dtype) and `offsets`
    (int64, documents + 1). Reading a window touches only its pages."""

    def __init__(self, directory: Path, index: TokenIndex, tokens: np.ndarray, offsets: np.ndarray):
        self.directory = directory
        self.index = index
        self.tokens = tokens
        self.offsets = offsets

    @staticmethod
    def is_prepared(directory: str | Path) -> bool:
        """Whether `directory` looks like a prepared directory (it has an `index.json`)."""
        return (Path(directory) / INDEX_FILE).is_file()

    @classmethod
    def open(cls, directory: str | Path) -> TokenStream:
        """Memory-map a prepared directory, checking its files against `index.json`."""
        root = Path(directory)
        if not root.is_dir():
            raise InvalidInput(f"{root}: not a prepared data directory (no such folder)")
        index = TokenIndex.from_json(root / INDEX_FILE)
        dtype = _DTYPES[index.dtype]
        tokens_path = root / TOKENS_FILE
        expected = index.tokens * dtype.itemsize
        size = tokens_path.stat().st_size if tokens_path.is_file() else None
        if size != expected:
            raise InvalidInput(
                f"{tokens_path}: {'missing' if size is None else f'{size} bytes'}; index.json "
                f"says {index.tokens} {index.dtype} tokens ({expected} bytes)"
            )
        tokens: np.ndarray
        if index.tokens:
            tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(index.tokens,))
        else:
            tokens = np.zeros(0, dtype=dtype)
        offsets = _load_offsets(root / DOCUMENTS_FILE, index)
        return cls(root, index, tokens, offsets)

    def __len__(self) -> int:
        return self.index.tokens

    @property
    def documents(self) -> int:
        return self.index.documents

    def document(self, k: int) -> np.ndarray:
        """The tokens of document `k` (its eos included)."""
        if not 0 <= k < self.documents:
            raise InvalidInput(f"{self.directory}: document {k} is not in [0, {self.documents})")
        return self.tokens[int(self.offsets[k]) : int(self.offsets[k + 1])]

    def check_vocab(self, vocab: int) -> None:
        """Raise unless every token id is below a model's vocabulary size `vocab`."""
        if self.index.max_token >= vocab:
            raise InvalidInput(
                f"{self.directory}: holds token id {self.index.max_token}, but the model's "
                f"vocabulary has {vocab} ids (0..{vocab - 1}); prepare the data with the "
                "model's tokenizer"
            )


def _load_offsets(path: Path, index: TokenIndex) -> np.ndarray:
    try:
        offsets: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise InvalidInput(f"{path}: cannot read it as a numpy array: {err}") from None
    if offsets.dtype != np.int64 or offsets.shape != (index.documents + 1,):
        raise InvalidInput(
            f"{path}: holds {offsets.dtype} {offsets.shape}; index.json says int64 "
            f"({index.documents + 1},) for {index.documents} documents"
        )
    if int(offsets[0]) != 0 or int(offsets[-1]) != index.tokens:
        raise InvalidInput(
            f"{path}: offsets run from {int(offsets[0])} to {int(offsets[-1])}; index.json says "
            f"0 to {index.tokens}"
        )
    return offsets
