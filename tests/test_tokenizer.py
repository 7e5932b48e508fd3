"""Tests of plugtrain.data.tokenizer and of scripts/train_tokenizer.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, processors

from plugtrain.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer
from plugtrain.testing import SAMPLE

SHAKESPEARE_TOKENIZER = SAMPLE / "tokenizer.json"
LINE = "To be, or not to be: that is the question:\n    Whether 'tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(SHAKESPEARE_TOKENIZER)


def test_round_trip_shakespeare_line(tok: Tokenizer) -> None:
    ids = tok.encode(LINE)
    assert tok.decode(ids) == LINE
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.bos_id not in ids and tok.eos_id not in ids  # no special tokens added
    assert len(ids) < len(LINE) / 2  # merges learned on Shakespeare compress his text


def test_round_trip_any_bytes(tok: Tokenizer) -> None:
    text = "naïve café — 東京 🎭\t\r\n"  # characters never seen in training
    assert tok.decode(tok.encode(text)) == text


def test_special_ids_and_vocab_size(tok: Tokenizer) -> None:
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2048)
    assert tok.decode([tok.bos_id, tok.eos_id]) == BOS_TOKEN + EOS_TOKEN
    assert tok.decode([tok.bos_id, tok.eos_id], skip_special_tokens=True) == ""


def test_byte_lengths_of_a_byte_level_bpe_sum_to_the_texts_utf8_bytes(tok: Tokenizer) -> None:
    lengths = tok.token_byte_lengths()
    assert len(lengths) == tok.vocab_size
    assert lengths[tok.bos_id] == lengths[tok.eos_id] == 0  # special tokens stand for no text
    text = "naïve café — 東京 🎭\t\r\n" + LINE  # characters split over several tokens
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) / 4 and max(lengths[i] for i in ids) > 1
    assert sum(lengths[i] for i in ids) == len(text.encode())


def test_byte_lengths_of_a_sentencepiece_style_bpe() -> None:
    """Llama 2's layout: a leading space added, "▁" for spaces, byte-fallback tokens."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(["▁", "t", "h", "é", "▁th"])})
    raw = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    raw.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    tok = Tokenizer(raw)
    text = "th thé 日"
    ids, lengths = tok.encode(text), tok.token_byte_lengths()
    assert tok.decode(ids) == text
    assert [lengths[i] for i in ids] == [1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1]
    # The dummy prefix (the leading "▁" the normalizer adds) counts as the space it stands for
    assert sum(lengths[i] for i in ids) == len(text.encode()) + 1
    assert lengths[vocab["▁th"]] == 3 and lengths[tok.eos_id] == 0


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = [LINE, "", "Exeunt.", LINE.upper()]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_missing_file_names_path_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"tokenizer file '{path}' not found: set model")
    ):
        Tokenizer.from_file(path)


def test_invalid_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=re.escape(f"tokenizer file '{path}' is not a valid")):
        Tokenizer.from_file(path)


def _save(tokenizer: tokenizers.Tokenizer, path: Path) -> Path:
    tokenizer.save(str(path))
    return path


def test_missing_end_of_text_is_an_error(tmp_path: Path) -> None:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.add_special_tokens(["<|endoftext|>"])  # GPT-2's name, not Llama 3's
    with pytest.raises(ValueError, match=r"has no '<\|end_of_text\|>' token"):
        Tokenizer.from_file(_save(raw, tmp_path / "gpt2ish.json"))


def test_llama3_style_post_processor_is_ignored(tmp_path: Path) -> None:
    """Llama 3's tokenizer.json prepends <|begin_of_text|> by default; encode must not."""
    raw = tokenizers.Tokenizer.from_file(str(SHAKESPEARE_TOKENIZER))
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, 0)]
    )
    assert raw.encode("Exeunt.").ids[0] == 0  # the post-processor is active in the library
    tok = Tokenizer.from_file(_save(raw, tmp_path / "llama3ish.json"))
    assert tok.encode("Exeunt.") == raw.encode("Exeunt.", add_special_tokens=False).ids
    assert tok.encode_batch(["Exeunt."]) == [tok.encode("Exeunt.")]


def test_bos_is_optional(tmp_path: Path) -> None:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.add_special_tokens([EOS_TOKEN])
    tok = Tokenizer.from_file(_save(raw, tmp_path / "eos_only.json"))
    assert (tok.bos_id, tok.eos_id) == (None, 0)


def test_train_script_is_deterministic(tmp_path: Path, repo: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text((json.dumps({"text": LINE}) + "\n") * 3)
    outputs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outputs:
        subprocess.run(
            [sys.executable, str(repo / "scripts" / "train_tokenizer.py"), "--input", str(corpus),
             "--output", str(out), "--vocab-size", "300"],
            check=True, capture_output=True,
        )  # fmt: skip
    assert outputs[0].read_bytes() == outputs[1].read_bytes()
    tok = Tokenizer.from_file(outputs[0])
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 300)
    assert tok.decode(tok.encode(LINE)) == LINE
