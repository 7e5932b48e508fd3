"""Train the byte-level BPE tokenizer shipped with the Shakespeare sample corpus.

Regenerate the committed ``core/src/plugtrain/sample/tokenizer.json`` from the repository root
with::

    python scripts/train_tokenizer.py

(defaults: ``--input core/src/plugtrain/sample/train.jsonl --output
core/src/plugtrain/sample/tokenizer.json --vocab-size 2048``). The result is deterministic: the
same input and vocabulary size give a byte-identical file.

The tokenizer is GPT-2 style byte-level BPE (any UTF-8 text round-trips exactly, no unknown
token) with the Llama 3 special token names ``<|begin_of_text|>`` and ``<|end_of_text|>`` at
ids 0 and 1, so ``plugtrain.data.tokenizer.Tokenizer`` treats it and a Llama 3 ``tokenizer.json``
alike. No post-processor is attached: the data pipeline adds the special tokens itself.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>"]


def iter_texts(path: Path) -> Iterator[str]:
    """Yield the "text" field of every non-blank line of a JSONL file."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def train(input_path: Path, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens (special tokens included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # NOTE: all 256 byte symbols are in the vocabulary even if the corpus lacks some, so
        # every input encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(input_path), trainer=trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sample = Path("core/src/plugtrain/sample")
    parser.add_argument("--input", type=Path, default=sample / "train.jsonl")
    parser.add_argument("--output", type=Path, default=sample / "tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        parser.error(
            f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + specials)"
        )
    tokenizer = train(args.input, args.vocab_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: pretty JSON (one token or merge per line) keeps diffs of the committed file readable.
    tokenizer.save(str(args.output), pretty=True)
    print(f"wrote {args.output} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
