"""The prepared token store: its manifest, and read-only memory maps of its token shards.

A prepared folder (written by ``plugtrain prepare-data``, see :mod:`plugtrain.data.prepare`)
holds ``manifest.json`` and, per shard, ``shard_NNNNN.bin`` (the tokens, ``uint16`` when the
vocabulary fits, ``uint32`` otherwise, in native little-endian order) and ``shard_NNNNN.idx``
(int64 end offsets of the shard's documents); a folder of chat data also holds
``shard_NNNNN.mask`` (one byte per token, 1 for the assistant's). The shards, concatenated in
order, are the corpus's token stream. :class:`TokenStore` opens them with ``numpy.memmap``:
opening costs neither time nor memory in proportion to the corpus, and the pages a batch
touches are read on demand by the kernel.

The ``.idx`` files are the documents' boundaries, whatever the tokenizer's special tokens (it
need not have a BOS, and a text may hold an EOS id): :meth:`TokenStore.documents` numbers the
documents of any range of the stream from them, for document masking and per-document
positions. Every folder of format 1 has them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from plugtrain.errors import DataError, MissingFileError

FORMAT_VERSION = 1
"""Version of the prepared folder's layout; a reader refuses any other."""
MANIFEST = "manifest.json"
PREPARE_HINT = "plugtrain prepare-data"


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of the file's bytes, read in ``chunk``-byte pieces (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (half the disk and page cache), ``uint32`` otherwise."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_manifest(folder: Path, key: str) -> dict[str, Any]:
    """The folder's manifest, checked for its format version; one-line errors name the fix."""
    path = folder / MANIFEST
    redo = f"run '{PREPARE_HINT}' to (re)write {folder}"
    if not path.is_file():
        raise MissingFileError(
            f"{key} '{folder}' has no {MANIFEST}: it is not a prepared folder; {redo}"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}): {redo}") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version {version!r}, but this plugtrain reads only "
            f"{FORMAT_VERSION}: {redo} with this version of plugtrain"
        )
    return manifest


class TokenStore:
    """The token stream of a prepared folder, as memory-mapped shards (read-only).

    ``tokenizer_sha256`` (the hash of the run's tokenizer.json), when given, must be the one
    the folder was prepared with. Every shard must exist with exactly the size the manifest
    gives (a cheap check that catches truncated and missing files; ``prepare-data`` records
    each shard's sha256 for a full check). ``key`` names the config key in error messages.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        tokenizer_sha256: str | None = None,
        key: str = "data.train_path",
    ) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder, key)
        theirs = self.manifest["tokenizer"]["sha256"]
        if tokenizer_sha256 is not None and theirs != tokenizer_sha256:
            raise DataError(
                f"{key} '{self.folder}' was prepared with another tokenizer (sha256 "
                f"{theirs[:12]}, model.tokenizer_path's is {tokenizer_sha256[:12]}): set "
                f"model.tokenizer_path to {self.manifest['tokenizer']['path']}, or run "
                f"'{PREPARE_HINT}' again with this tokenizer"
            )
        self.dtype = np.dtype(self.manifest["dtype"])
        self.chat: dict[str, Any] | None = self.manifest.get("chat")
        """The manifest's counts of conversations (kept, truncated, dropped); None for text."""
        self._shards: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []  # each shard's document end offsets (its .idx)
        self._masks: list[np.ndarray] = []
        self._starts: list[int] = []  # token offset of each non-empty shard in the stream
        total = 0
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            self._check_size("shard", path, shard["num_tokens"] * self.dtype.itemsize)
            if shard["num_tokens"]:
                self._shards.append(np.memmap(path, dtype=self.dtype, mode="r"))
                self._ends.append(self._open_index(shard))
                if self.chat is not None:
                    self._masks.append(self._open_mask(shard))
                self._starts.append(total)
                total += shard["num_tokens"]
        if total != self.manifest["num_tokens"]:
            raise DataError(
                f"{self.folder / MANIFEST} counts {self.manifest['num_tokens']} tokens but its "
                f"shards hold {total}: run '{PREPARE_HINT}' again to rewrite {self.folder}"
            )
        self.num_tokens = total

    def _open_index(self, shard: dict[str, Any]) -> np.ndarray:
        """The shard's document end offsets (memory-mapped), checked for their size."""
        path = self.folder / shard["index"]
        self._check_size("document index", path, shard["num_documents"] * 8)  # int64 offsets
        return np.memmap(path, dtype=np.int64, mode="r")

    def _open_mask(self, shard: dict[str, Any]) -> np.ndarray:
        """The shard's loss mask, one byte a token (memory-mapped), checked for its size."""
        path = self.folder / shard.get("mask", "")
        self._check_size("mask", path, shard["num_tokens"])
        return np.memmap(path, dtype=np.uint8, mode="r")

    def _check_size(self, kind: str, path: Path, expected: int) -> None:
        """Refuse, in one line, a file of the folder that is missing or not ``expected`` bytes."""
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            what = "is missing" if size is None else f"has {size} bytes, not {expected}"
            raise DataError(
                f"{kind} {path} {what} (truncated or damaged): run '{PREPARE_HINT}' again to "
                f"rewrite {self.folder}"
            )

    @property
    def num_documents(self) -> int:
        """The documents of the stream (its shards' indexes)."""
        return sum(len(ends) for ends in self._ends)

    def document_span(self, index: int) -> tuple[int, int]:
        """Where document ``index`` (numbered from 0 over the stream) lies in it:
        ``(start, end)``, end excluded."""
        left = index
        for base, ends in zip(self._starts, self._ends, strict=True):
            if 0 <= left < len(ends):  # a shard starts where a document does
                return base + (int(ends[left - 1]) if left else 0), base + int(ends[left])
            left -= len(ends)
        raise IndexError(f"document {index} out of [0, {self.num_documents})")

    def document_of(self, positions: np.ndarray) -> np.ndarray:
        """The document each token position of ``positions`` is in, numbered from 0 over the
        stream (int64): a binary search in each shard's ``.idx``."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and not (positions.min() >= 0 and positions.max() < self.num_tokens):
            raise IndexError(f"token positions out of [0, {self.num_tokens})")
        found = np.empty_like(positions)
        before = 0  # the documents of the shards before
        for base, ends, shard in zip(self._starts, self._ends, self._shards, strict=True):
            inside = (positions >= base) & (positions < base + len(shard))
            found[inside] = before + np.searchsorted(ends, positions[inside] - base, "right")
            before += len(ends)
        return found

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer the folder was prepared with."""
        return int(self.manifest["tokenizer"]["vocab_size"])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream (a copy, in the store's dtype)."""
        return self._read(self._shards, start, length)

    def read_mask(self, start: int, length: int) -> np.ndarray | None:
        """Whether each of tokens ``[start, start + length)`` is the assistant's (a copy, one
        byte each); None for text, which has no mask."""
        return None if self.chat is None else self._read(self._masks, start, length)

    def _read(self, shards: list[np.ndarray], start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of [0, {self.num_tokens})")
        i = bisect.bisect_right(self._starts, start) - 1
        offset = start - self._starts[i]
        first = shards[i][offset : offset + length]
        if len(first) == length:
            return np.array(first)
        pieces = [first]  # the range runs into the next shard(s)
        got = len(first)
        while got < length:
            i += 1
            pieces.append(shards[i][: length - got])
            got += len(pieces[-1])
        return np.concatenate(pieces)

    def documents(self, start: int, length: int) -> np.ndarray:
        """The document of each token ``[start, start + length)``: int32, numbered from 0 at
        ``start`` (``0 0 0 1 1 2 ...``). Found by binary search in the shards' ``.idx``, so the
        cost grows with the documents in the range, not with the corpus."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of [0, {self.num_tokens})")
        first = np.zeros(length, dtype=np.int32)  # 1 where a document after the first starts
        end, at = start + length, start
        i = bisect.bisect_right(self._starts, start) - 1
        while True:
            base, ends = self._starts[i], self._ends[i]
            lo, hi = at - base, min(end - base, len(self._shards[i]))
            # The documents ending strictly inside the part read: the next one starts there.
            inside = ends[np.searchsorted(ends, lo, "right") : np.searchsorted(ends, hi, "left")]
            first[inside + (base - start)] = 1
            at = base + hi
            if at == end:
                return np.cumsum(first, dtype=np.int32)
            first[at - start] = 1  # a shard ends where a document does
            i += 1


def document_offsets(folder: str | os.PathLike[str], shard: int) -> np.ndarray:
    """End offset (exclusive, within the shard) of each document of shard ``shard``."""
    manifest = read_manifest(Path(folder), "folder")
    return np.fromfile(Path(folder) / manifest["shards"][shard]["index"], dtype=np.int64)
