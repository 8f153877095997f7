"""Documents read from the inputs the user names, in the order given.

Each input is a file or a folder. A folder stands for the files under it, recursively, in sorted
path order, leaving out hidden entries (names starting with `.`: the token caches `prepare` keeps
beside its inputs are hidden, so a folder never reads its own cache). A file is read by its
suffix:

- `.jsonl`: one JSON object per line, the document in a string field (`text` unless told);
  blank lines are skipped;
- `.parquet`: a string column (`text` unless told), read one row group at a time;
- anything else: plain UTF-8 text, the whole file one document.

Every error names the file, and for jsonl the line (1-based). An empty file, or one that holds no
document, is an error: an input that contributes nothing is more likely a mistake than intended.
This module reads; it neither tokenizes nor writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from liveshard_core.errors import InvalidInput

DEFAULT_FIELD = "text"


def input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files the inputs stand for, in order: a file as itself, a folder as its non-hidden
    files, recursively, in sorted path order."""
    if not inputs:
        raise InvalidInput("no input given: name at least one file or folder")
    files: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))
            )
            if not found:
                raise InvalidInput(f"{path}: the folder holds no (non-hidden) files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise InvalidInput(f"{path}: no such file or folder")
    return files


def documents(inputs: Sequence[str | Path], field: str = DEFAULT_FIELD) -> Iterator[str]:
    """Every document of the inputs, in input order (see the module docstring)."""
    for path in input_files(inputs):
        yield from file_documents(path, field)


def file_documents(path: Path, field: str = DEFAULT_FIELD) -> Iterator[str]:
    """The documents of one file, read by its suffix."""
    try:
        if path.stat().st_size == 0:
            raise InvalidInput(f"{path}: the file is empty")
    except OSError as err:
        raise InvalidInput(f"{path}: cannot read it: {err.strerror}") from None
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path, field)
    elif suffix == ".parquet":
        yield from _parquet(path, field)
    else:
        yield _text(path)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    count = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InvalidInput(f"{where}: not UTF-8 text ({err.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InvalidInput(f"{where}: invalid JSON: {err.msg}") from None
            if not isinstance(record, dict):
                kind = type(record).__name__
                raise InvalidInput(f"{where}: expected a JSON object, got a {kind}")
            if field not in record:
                raise InvalidInput(f"{where}: the record has no field {field!r}")
            text = record[field]
            if not isinstance(text, str):
                kind = type(text).__name__
                raise InvalidInput(f"{where}: field {field!r} is a {kind}, not a string")
            count += 1
            yield text
    if count == 0:
        raise InvalidInput(f"{path}: holds no documents (only blank lines)")


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise InvalidInput(f"{path}: not a readable parquet file: {err}") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise InvalidInput(f"{path}: no column {field!r}; the columns are {names}")
    kind = parquet.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise InvalidInput(f"{path}: column {field!r} holds {kind}, not strings")
    if parquet.metadata.num_rows == 0:
        raise InvalidInput(f"{path}: holds no documents (no rows)")
    row = 0
    for group in range(parquet.num_row_groups):
        column = parquet.read_row_group(group, columns=[field]).column(0)
        if column.null_count:
            nulls = column.is_null().to_pylist()
            raise InvalidInput(f"{path}: row {row + nulls.index(True)}: column {field!r} is null")
        texts: list[str] = column.to_pylist()
        row += len(texts)
        yield from texts


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidInput(
            f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); name a .jsonl or "
            ".parquet file, or convert it to UTF-8"
        ) from None
