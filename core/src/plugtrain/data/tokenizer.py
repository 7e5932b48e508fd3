"""A thin wrapper around a Hugging Face ``tokenizers`` tokenizer.json file.

The trainer needs only a few things from a tokenizer: the vocabulary size (to size the
embedding), the beginning/end-of-text ids (to delimit documents), and fast encode/decode. Both
the shipped Shakespeare tokenizer (``scripts/train_tokenizer.py``) and Llama 3's tokenizer.json
name their special tokens ``<|begin_of_text|>`` and ``<|end_of_text|>``, so either loads here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import tokenizers
from tokenizers import pre_tokenizers

from plugtrain import sample
from plugtrain.errors import DataError, MissingFileError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A byte-fallback token's string (SentencePiece-style BPE): one byte."""


def _fix() -> str:
    """How to set model.tokenizer_path, with the shipped sample's tokenizer as example."""
    return f"set model.tokenizer_path to a tokenizer.json (e.g. {sample.PREFIX}tokenizer.json)"


class Tokenizer:
    """Encode text to token ids and back; never adds special tokens implicitly.

    Build it with :meth:`from_file`. ``encode`` ignores any post-processor the file defines
    (Llama 3's prepends ``<|begin_of_text|>``): the data pipeline places ``bos_id`` and
    ``eos_id`` itself, so every tokenizer yields the same document layout.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, source: str = "<in memory>") -> None:
        self._tokenizer = tokenizer
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise DataError(
                f"tokenizer {source!r} has no {EOS_TOKEN!r} token, which marks document ends: "
                f"{_fix()}, or add that special token when training it"
            )
        self._eos_id: int = eos_id
        self._bos_id: int | None = tokenizer.token_to_id(BOS_TOKEN)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer.json (``sample:tokenizer.json``: the shipped sample's, see
        :func:`plugtrain.sample.resolve`); raise FileNotFoundError or ValueError naming it."""
        path = sample.resolve(path)
        if not path.is_file():
            raise MissingFileError(f"tokenizer file '{path}' not found: {_fix()}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise DataError(
                f"tokenizer file '{path}' is not a valid tokenizer.json ({e}): {_fix()}"
            ) from e
        return cls(tokenizer, source=str(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included (the embedding's row count)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        """Id of ``<|begin_of_text|>``, or None if the tokenizer lacks it."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of ``<|end_of_text|>`` (always present: loading fails without it)."""
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text``, without added special tokens (special tokens written in the
        text are recognised), and each token's character span ``(start, end)`` in it."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens, encoded in parallel by the library.

        The library's thread pool is disabled in a process forked after it was used
        (it warns about TOKENIZERS_PARALLELISM); tokenize before starting worker processes.
        """
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept (visible document boundaries) by default."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_byte_lengths(self) -> list[int]:
        """The UTF-8 bytes of text each id stands for, by id: what bits per byte divide by.

        Summed over a text's ids, they give the bytes of the text as the tokenizer saw it (after
        its normalizer, if it has one). Special tokens stand for no text: 0. A byte-level BPE
        token (GPT-2's, Llama 3's, the sample's) stands for one byte per character of its
        vocabulary string, so that a character split over several tokens counts once, with its
        own length; a byte-fallback token (``<0xE2>``) for 1. Any other token stands for the
        bytes its decoding adds after the same token, so that a decoder's rule for a text's
        first token (SentencePiece drops its leading space) does not apply.
        """
        spec = json.loads(self._tokenizer.to_str())
        decoder = spec.get("decoder") or {}
        byte_level = "ByteLevel" in {d.get("type") for d in decoder.get("decoders", [decoder])}
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        added = self._tokenizer.get_added_tokens_decoder()
        lengths: list[int | None] = []
        for i in range(self.vocab_size):
            token, text = added.get(i), self._tokenizer.id_to_token(i)
            if token is not None:
                lengths.append(0 if token.special else len(token.content.encode()))
            elif text is None:
                lengths.append(0)  # an id with no token: never in the data
            elif byte_level and set(text) <= alphabet:
                lengths.append(len(text))
            elif byte_fallback and _BYTE_TOKEN.fullmatch(text):
                lengths.append(1)
            else:
                lengths.append(None)
        rest = [i for i, n in enumerate(lengths) if n is None]
        if rest:
            twice = self._tokenizer.decode_batch([[i, i] for i in rest], skip_special_tokens=False)
            once = self._tokenizer.decode_batch([[i] for i in rest], skip_special_tokens=False)
            for i, two, one in zip(rest, twice, once, strict=True):
                lengths[i] = len(two.encode()) - len(one.encode())
        return [n or 0 for n in lengths]
