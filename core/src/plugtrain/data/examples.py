"""Examples as training sees them, each token with whether the loss trains on it.

What ``plugtrain inspect-data`` prints: the documents of a token stream (a conversation each,
for chat data), or the rows of ``seq_len + 1`` tokens a run draws from it. The stream is a
prepared folder read as a run reads it (:class:`~plugtrain.data.store.TokenStore`), or the first
documents of a data file, encoded by the function ``prepare-data``'s workers run
(:func:`~plugtrain.data.prepare.encode_chunk`: chat data rendered by its chat template, its
assistant mask found, long conversations cut or dropped): the tokens and the mask its
preparation writes, read from a file of any size in the time its first documents take.

A document's token is trained when the loss mask counts it (the assistant's tokens of a
conversation; every token of text, or of chat data with ``data.chat_loss = "all"``). A row is
cut and masked by :class:`~plugtrain.data.pipeline.PackedDataset` itself: a token is trained
when its target is not :data:`~plugtrain.data.pipeline.IGNORE_INDEX`, so a row's first token,
an input only, never is.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from plugtrain.data.chat import ChatOptions
from plugtrain.data.pipeline import IGNORE_INDEX, PackedDataset, TokenStream
from plugtrain.data.prepare import chat_encoder, encode_chunk
from plugtrain.data.sources import check_extras, expand_inputs, iter_documents
from plugtrain.data.store import token_dtype
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError

__all__ = [
    "DocumentStream",
    "Example",
    "FileHead",
    "document_examples",
    "read_head",
    "row_examples",
]


class DocumentStream(TokenStream, Protocol):
    """A token stream that knows its documents: a :class:`~plugtrain.data.store.TokenStore`,
    or a :class:`FileHead`."""

    chat: dict[str, Any] | None
    """The chat data's record (``template``, ``conversations``, ``truncated``, ``dropped``,
    ``max_tokens``, as a prepared folder's manifest holds it); None for text."""

    @property
    def num_documents(self) -> int: ...

    def document_span(self, index: int) -> tuple[int, int]:
        """Where document ``index`` lies in the stream: ``(start, end)``, end excluded."""
        ...


@dataclass(frozen=True)
class Example:
    """A document or a row: its tokens, and whether the loss trains on each."""

    name: str
    """``document 3`` or ``row 0``."""
    ids: np.ndarray
    trained: np.ndarray
    """One bool per token of ``ids``."""


class FileHead:
    """The first documents of data files, encoded as ``prepare-data`` encodes them: a
    :class:`DocumentStream` held in memory (:func:`read_head`)."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        self._tokens, self._mask = tokens, mask
        self._ends = np.cumsum(lengths)
        self.num_tokens = len(tokens)
        self.chat: dict[str, Any] | None = None

    @property
    def num_documents(self) -> int:
        return len(self._ends)

    def document_span(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of [0, {self.num_documents})")
        return int(self._ends[index - 1]) if index else 0, int(self._ends[index])

    def read(self, start: int, length: int) -> np.ndarray:
        return self._tokens[start : start + length].copy()

    def read_mask(self, start: int, length: int) -> np.ndarray | None:
        return None if self._mask is None else self._mask[start : start + length].copy()

    def documents(self, start: int, length: int) -> np.ndarray:
        at = np.arange(start, start + length)
        ids = np.searchsorted(self._ends, at, side="right")
        return (ids - ids[:1]).astype(np.int32)


def read_head(
    inputs: Sequence[str],
    tokenizer_path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    chat: ChatOptions | None = None,
    min_documents: int = 0,
    min_tokens: int = 0,
) -> FileHead:
    """The first documents of ``inputs`` (files or globs, as ``prepare-data`` takes them): at
    least ``min_documents`` of them and ``min_tokens`` tokens, or all there are; ``chat`` says
    whether and how they are read as chat data (default: detected)."""
    chat = chat or ChatOptions()
    files = expand_inputs(inputs)
    check_extras(files)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    encoder = chat_encoder(files, tokenizer_path, chat)
    dtype = token_dtype(tokenizer.vocab_size)
    texts = itertools.chain.from_iterable(
        iter_documents(f, text_field, chat=encoder is not None) for f in files
    )
    pieces, count, length, truncated, dropped = [], 0, 0, 0, 0
    for text, _, _ in texts:
        # One at a time: a dropped conversation is not a document, and reading stops as soon
        # as enough are read.
        encoded = encode_chunk([text], tokenizer, dtype, encoder)
        pieces.append(encoded)
        count += len(encoded.lengths)
        length += len(encoded.tokens)
        truncated += encoded.truncated
        dropped += encoded.dropped
        if count >= min_documents and length >= min_tokens:
            break
    if not count:
        raise DataError(f"inputs {list(inputs)} hold no documents: give non-empty files")
    mask = None if encoder is None else np.concatenate([p.mask for p in pieces])
    head = FileHead(
        np.concatenate([p.tokens for p in pieces]),
        np.concatenate([p.lengths for p in pieces]),
        mask,
    )
    if encoder is not None:
        head.chat = {
            "template": encoder.template.origin,
            **encoder.key(),
            "template_record": encoder.template.record(),
            "conversations": count + dropped,
            "truncated": truncated,
            "dropped": dropped,
        }
    return head


def _trained(mask: np.ndarray | None, length: int) -> np.ndarray:
    return np.ones(length, dtype=bool) if mask is None else mask != 0


def document_examples(
    stream: DocumentStream, start: int, count: int, *, loss_mask: bool = True
) -> list[Example]:
    """Documents ``start`` to ``start + count`` of ``stream`` (those there are); ``loss_mask``
    False trains on every token (``data.chat_loss = "all"``)."""
    examples = []
    for index in range(start, min(start + count, stream.num_documents)):
        begin, end = stream.document_span(index)
        mask = stream.read_mask(begin, end - begin) if loss_mask else None
        examples.append(
            Example(
                f"document {index}", stream.read(begin, end - begin), _trained(mask, end - begin)
            )
        )
    return examples


def row_examples(
    stream: TokenStream,
    seq_len: int,
    start: int,
    count: int,
    *,
    loss_mask: bool = True,
    source: str = "the token stream",
) -> list[Example]:
    """Rows ``start`` to ``start + count`` (those there are) of the samples a run of
    ``seq_len`` draws from ``stream``, as its batches mask them (``source`` names the stream in
    errors)."""
    dataset = PackedDataset(stream, seq_len, source=source, loss_mask=loss_mask)
    examples = []
    for index in range(start, min(start + count, len(dataset))):
        targets = dataset.collate([index]).targets[0].numpy()
        trained = np.concatenate([[False], targets != IGNORE_INDEX])
        examples.append(Example(f"row {index}", dataset.tokens(index), trained))
    return examples
