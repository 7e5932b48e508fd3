"""A thin wrapper around a Hugging Face ``tokenizers`` tokenizer.json file.

The trainer needs only a few things from a tokenizer: the vocabulary size (to size the
embedding), the beginning/end-of-text ids (to delimit documents), and fast encode/decode. Both
the shipped Shakespeare tokenizer (``scripts/train_tokenizer.py``) and Llama 3's tokenizer.json
name their special tokens ``<|begin_of_text|>`` and ``<|end_of_text|>``, so either loads here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from plugtrain import sample
from plugtrain.errors import DataError, MissingFileError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


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
        """Load a tokenizer.json; raise FileNotFoundError or ValueError naming the path."""
        path = Path(path)
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
