"""The in-memory data path, the oracle that tests check ``prepare-data`` and the store against.

:func:`load_jsonl_texts` reads a JSONL file's texts, :func:`tokenize_documents` frames each
document as ``[bos] tokens [eos]`` into one stream, :class:`InMemoryStream` holds it for a
:class:`~plugtrain.data.pipeline.PackedDataset`, and :func:`build_dataset` does all three. The
trainer never uses it: it reads prepared folders (:mod:`plugtrain.data.store`), whose tokens
must equal these exactly. :func:`packed_documents` packs random documents of given lengths
into rows, with their documents and positions, and :func:`document_spans` finds each
document of a row again: the oracle of document masking (each document alone).
:func:`stored_documents` reads each document of a prepared folder back (a chat run's ids, to
compare with transformers' ``apply_chat_template``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from plugtrain.data import (
    MicroBatch,
    PackedDataset,
    Tokenizer,
    TokenStore,
    document_positions,
    iter_documents,
)
from plugtrain.errors import DataError, MissingFileError


def load_jsonl_texts(
    path: str | os.PathLike[str], field: str = "text", *, key: str = "data.train_path"
) -> list[str]:
    """Return the string ``field`` of every non-blank line of the JSONL file at ``path``.

    ``key`` is the config key the path came from; error messages name it as the fix. Raises
    FileNotFoundError for a missing file and ValueError (naming the line) for a line that is
    not a JSON object holding a string ``field``, or for a file without any document.
    """
    path = Path(path)
    where = f"data file '{path}'"
    if not path.is_file():
        raise MissingFileError(
            f"{where} not found: set {key} to a JSONL file with one {{{field!r}: ...}} per line"
        )
    texts = [text for text, _, _ in iter_documents(path, field, label="data file")]
    if not texts:
        raise DataError(f"{where} holds no documents: set {key} to a non-empty JSONL file")
    return texts


def tokenize_documents(texts: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """Encode ``texts`` into one 1-D int32 stream of ``[bos] tokens [eos]`` per document.

    ``bos`` is left out when the tokenizer has no ``<|begin_of_text|>``. int32 halves
    the memory of int64 and holds any real vocabulary; :class:`PackedDataset` widens each
    sample to the int64 that embedding lookups and cross-entropy take.
    """
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    stream: list[int] = []
    for ids in tokenizer.encode_batch(texts):
        stream += head
        stream += ids
        stream.append(tokenizer.eos_id)
    return torch.tensor(stream, dtype=torch.int32)


class InMemoryStream:
    """A token stream held in memory (a 1-D tensor), read like a
    :class:`~plugtrain.data.store.TokenStore`; ``document_ends`` (each document's end offset,
    exclusive, ascending) gives it documents."""

    def __init__(self, stream: torch.Tensor, document_ends: Sequence[int] | None = None) -> None:
        if stream.dim() != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tuple(stream.shape)}")
        self._stream = stream.numpy()
        self.num_tokens = stream.numel()
        self._ends = None if document_ends is None else np.asarray(document_ends, np.int64)

    def documents(self, start: int, length: int) -> np.ndarray:
        """The document of each token ``[start, start + length)``, numbered from 0."""
        if self._ends is None:
            raise ValueError("this InMemoryStream was made without document_ends")
        ids = np.searchsorted(self._ends, np.arange(start, start + length), "right")
        return (ids - ids[0]).astype(np.int32)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream."""
        return self._stream[start : start + length]


def build_dataset(
    path: str | os.PathLike[str], key: str, tokenizer: Tokenizer, field: str, seq_len: int
) -> PackedDataset:
    """Load, tokenize and pack the JSONL file at ``path`` (config key ``key``) in one call."""
    stream = tokenize_documents(load_jsonl_texts(path, field, key=key), tokenizer)
    return PackedDataset(InMemoryStream(stream), seq_len, source=f"{key} '{path}'")


def packed_documents(
    lengths: Sequence[Sequence[int]], vocab_size: int, seed: int = 0
) -> MicroBatch:
    """Rows of random tokens packed from documents of ``lengths`` (one sequence per row, each
    summing to the same length), with their ``documents`` and per-document ``positions``."""
    tokens = torch.randint(
        0,
        vocab_size,
        (len(lengths), sum(lengths[0]) + 1),
        generator=torch.Generator().manual_seed(seed),
    )
    ids = np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)
    return MicroBatch(
        tokens[:, :-1],
        tokens[:, 1:],
        torch.from_numpy(ids),
        torch.from_numpy(document_positions(ids)),
    )


def document_spans(documents: torch.Tensor) -> list[slice]:
    """Where each document of one row of ``documents`` (``MicroBatch.documents[row]``) lies."""
    starts = [0, *((documents[1:] != documents[:-1]).nonzero().flatten() + 1).tolist()]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(documents)], strict=True)]


def stored_documents(folder: str | os.PathLike[str]) -> list[list[int]]:
    """Each document's token ids in prepared ``folder``, in order: for chat data, each kept
    conversation as the run trains on it (cut to ``seq_len`` if it was)."""
    store = TokenStore(folder)
    spans = (store.document_span(i) for i in range(store.num_documents))
    return [store.read(start, end - start).tolist() for start, end in spans]
