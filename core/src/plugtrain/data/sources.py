"""Input documents of ``prepare-data``: the files that paths and globs name, and their texts.

Formats: JSONL (plain, gzip or zstd), Parquet, plain text (one document per file); chat data
(a conversation per line, :mod:`plugtrain.data.chat`) is JSONL only.

Every reader yields ``(text, nbytes, position)`` (``text`` a conversation's messages for chat
data): ``nbytes`` is the document's size in the
input's uncompressed text (how ``prepare-data`` cuts chunks), ``position`` how many bytes of the
file on disk have been read so far (what its progress counts, compressed or not). A reader holds
at most one line, record batch or file in memory.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from plugtrain import sample
from plugtrain.data.chat import Conversation, check_conversation
from plugtrain.data.preference import check_preference, is_preference
from plugtrain.errors import DataError, MissingFileError, require_extra

SUFFIXES = (
    ".jsonl",
    ".json",
    ".jsonl.gz",
    ".json.gz",
    ".jsonl.zst",
    ".json.zst",
    ".parquet",
    ".txt",
)
"""The file types read; a folder contributes every such file under it, recursively."""


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """The files that ``inputs`` (files, folders, globs) name, in a stable order.

    Each input's files are sorted; inputs keep their order. A name that matches nothing or a
    file of an unknown type is a one-line error.
    """
    files: list[Path] = []
    for item in map(str, map(sample.resolve, inputs)):
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise MissingFileError(
                f"input '{item}' not found: give existing files, folders or globs"
            )
        for match in map(Path, matches):
            if match.is_dir():
                files += sorted(p for p in match.rglob("*") if p.is_file() and _kind(p))
            elif _kind(match):
                files.append(match)
            else:
                raise DataError(
                    f"input '{match}' is not a supported type: give {', '.join(SUFFIXES)} files"
                )
    if not files:
        raise DataError(
            f"inputs {list(inputs)} hold no {', '.join(SUFFIXES)} file: give files of those types"
        )
    return files


def check_extras(files: Sequence[Path]) -> None:
    """Stop before any work if a file needs an optional package that is not installed."""
    kinds = {_kind(f) for f in files}
    if kinds & {".parquet"}:
        require_extra("pyarrow", "parquet", "reading Parquet input")
    if kinds & {".jsonl.zst", ".json.zst"}:
        require_extra("zstandard", "zstd", "reading zstd-compressed input")


def _decompressed(raw: IO[bytes], kind: str) -> IO[bytes]:
    """A reader of ``raw``'s content (``raw`` itself when not compressed) that leaves it open."""
    if kind.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, closefd=False)
    return raw


def _records(path: Path, kind: str, label: str) -> Iterator[tuple[int, bytes, Any, int]]:
    """``(line number, line, record, file bytes read)`` of each non-empty line of a JSONL file."""
    # Unbuffered: tell() is how much of the file was read. Closed by the with.
    raw = open(path, "rb", buffering=0)  # noqa: SIM115
    with raw, _decompressed(raw, kind) as stream:
        for lineno, line in enumerate(io.BufferedReader(stream), start=1):  # type: ignore[arg-type]
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{label} '{path}' line {lineno} is not valid JSON: {e}") from e
            yield lineno, line, record, raw.tell()


def is_chat(path: Path, data_format: str = "auto", *, label: str = "input") -> bool:
    """Whether ``path`` holds chat data under ``data.format`` ``data_format``: forced, or
    (``auto``) a JSONL file whose first record holds ``messages``, or ``chosen`` and
    ``rejected`` (preference data, :mod:`plugtrain.data.preference`)."""
    kind = _kind(path)
    if data_format == "chat":
        _check_jsonl(path, kind, label)
    if data_format != "auto" or kind in (None, ".parquet", ".txt"):
        return data_format == "chat"
    first = next(_records(path, str(kind), label), None)
    if first is None:
        return False
    return (isinstance(first[2], dict) and "messages" in first[2]) or is_preference(first[2])


def _check_jsonl(path: Path, kind: str | None, label: str) -> None:
    if kind in (None, ".parquet", ".txt"):
        raise DataError(
            f"{label} '{path}' is not JSONL, but is read as chat data: chat data is one "
            f'{{"messages": [...]}} per line of a .jsonl file (or set data.format = "text")'
        )


def _jsonl(
    path: Path, kind: str, field: str, label: str, chat: bool
) -> Iterator[tuple[Any, int, int]]:
    pairs = None  # preference data or conversations: as the first record is
    for lineno, line, record, position in _records(path, kind, label):
        if chat:
            where = f"{label} '{path}' line {lineno}"
            pairs = is_preference(record) if pairs is None else pairs
            if pairs:
                yield check_preference(record, where), len(line), position
                continue
            messages = check_conversation(record, where)
            yield Conversation(messages, f"{path}:{lineno}"), len(line), position
            continue
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DataError(
                f"{label} '{path}' line {lineno} is not a JSON object with a string field "
                f"{field!r}: fix that line or set data.text_field (prepare-data: --text-field)"
            )
        yield record[field], len(line), position


def _parquet(path: Path, field: str) -> Iterator[tuple[str, int, int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise DataError(
            f"input '{path}' has no column {field!r} (columns: {parquet.schema_arrow.names}): "
            f"set data.text_field (prepare-data: --text-field)"
        )
    size = path.stat().st_size
    rows = max(1, parquet.metadata.num_rows)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1  # compressed bytes are not per row: spread the file's size evenly
            yield text or "", size // rows, size * row // rows


def iter_documents(
    path: Path, field: str = "text", *, label: str = "input", chat: bool = False
) -> Iterator[tuple[Any, int, int]]:
    """``(text, text bytes, file bytes read)`` of every document of ``path`` (see the module
    doc); a .txt file is one document. With ``chat``, ``text`` is each line's checked
    ``messages`` (:func:`~plugtrain.data.chat.check_conversation`), a
    :class:`~plugtrain.data.chat.Conversation` that knows its ``path:line``.

    Errors name the file as ``{label} '{path}'``."""
    kind = _kind(path)
    if chat:
        _check_jsonl(path, kind, label)
    if kind == ".parquet":
        yield from _parquet(path, field)
    elif kind == ".txt":
        data = path.read_bytes()
        yield data.decode("utf-8", errors="replace"), len(data), len(data)
    elif kind is not None:
        yield from _jsonl(path, kind, field, label, chat)
    else:
        raise DataError(f"input '{path}' is not a supported type: give {', '.join(SUFFIXES)}")
