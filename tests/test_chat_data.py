"""Tests of chat data in prepare-data and the run: detection, the stored conversations and
their masks, the refusals, and conversations longer than the sequence."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from plugtrain.config import JobConfig, ModelConfig
from plugtrain.data import IGNORE_INDEX, PackedDataset
from plugtrain.data.chat import ChatOptions, ChatTemplate, encode_conversation
from plugtrain.data.prepare import prepare
from plugtrain.data.store import TokenStore, document_offsets
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError
from plugtrain.model import FLAVORS, Transformer, cross_entropy
from plugtrain.testing import SAMPLE, document_spans, make_trainer

CHAT = SAMPLE / "chat_validation.jsonl"
TOKENIZER = SAMPLE / "tokenizer.json"


def conversations(path: Path = CHAT) -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_the_sample_is_what_its_script_writes(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_chat_sample.py"
    subprocess.run([sys.executable, script, "--out", tmp_path], check=True)
    for name in ("chat_train.jsonl", "chat_validation.jsonl"):
        assert (tmp_path / name).read_bytes() == (SAMPLE / name).read_bytes()


def test_a_chat_file_is_detected_and_stored_one_conversation_per_document(tmp_path: Path) -> None:
    result = prepare([str(CHAT)], tmp_path / "out", TOKENIZER, workers=1, progress=False)
    store = TokenStore(result.folder)
    tokenizer, template = Tokenizer.from_file(TOKENIZER), ChatTemplate.for_tokenizer(TOKENIZER)
    encoded = [encode_conversation(m, template, tokenizer) for m in conversations()]
    assert store.read(0, store.num_tokens).tolist() == [i for ids, _ in encoded for i in ids]
    mask = store.read_mask(0, store.num_tokens)
    assert mask is not None and mask.tolist() == np.concatenate([m for _, m in encoded]).tolist()
    ends = np.cumsum([len(ids) for ids, _ in encoded])
    assert document_offsets(result.folder, 0).tolist() == ends.tolist()
    assert store.chat is not None
    assert (store.chat["conversations"], store.chat["truncated"], store.chat["dropped"]) == (
        len(encoded),
        0,
        0,
    )
    # Text data has no mask, and forcing text on chat data asks for the text field.
    text = prepare([str(SAMPLE / "validation.jsonl")], tmp_path / "t", TOKENIZER, workers=1)
    assert TokenStore(text.folder).read_mask(0, 4) is None
    with pytest.raises(DataError, match=r"line 1 is not a JSON object with a string field 'text'"):
        prepare(
            [str(CHAT)],
            tmp_path / "x",
            TOKENIZER,
            workers=1,
            progress=False,
            chat=ChatOptions("text"),
        )


@pytest.mark.slow  # worker processes start
def test_workers_write_the_same_bytes(tmp_path: Path) -> None:
    one = prepare([str(CHAT)], tmp_path / "one", TOKENIZER, workers=1, progress=False)
    two = prepare([str(CHAT)], tmp_path / "two", TOKENIZER, workers=2, progress=False,
                  chunk_bytes=4096)  # fmt: skip
    for name in ("shard_00000.bin", "shard_00000.mask"):
        assert (one.folder / name).read_bytes() == (two.folder / name).read_bytes()


@pytest.mark.parametrize(("overlong", "kept"), [("truncate", 60), ("drop", None)])
def test_long_conversations_are_truncated_or_dropped(
    tmp_path: Path, overlong: str, kept: int | None
) -> None:
    tokenizer, template = Tokenizer.from_file(TOKENIZER), ChatTemplate.for_tokenizer(TOKENIZER)
    lengths = [len(encode_conversation(m, template, tokenizer)[0]) for m in conversations()]
    limit = sorted(lengths)[len(lengths) // 2]
    longer = sum(n > limit for n in lengths)
    options = ChatOptions(max_tokens=limit, overlong=overlong)
    folder = prepare(
        [str(CHAT)], tmp_path / overlong, TOKENIZER, workers=1, progress=False, chat=options
    )
    store = TokenStore(folder.folder)
    assert store.chat is not None
    truncated, dropped = (longer, 0) if overlong == "truncate" else (0, longer)
    assert (store.chat["truncated"], store.chat["dropped"]) == (truncated, dropped)
    kept_lengths = [min(n, limit) for n in lengths if overlong == "truncate" or n <= limit]
    assert store.num_tokens == sum(kept_lengths)
    assert store.manifest["num_documents"] == (kept or len(lengths) - longer)
    # The lengths before cutting, cut or dropped alike: the shortest seq_len fitting 54 of
    # the 60 conversations (90%), 60 of 60 (99%, all).
    ordered = sorted(lengths)
    fit = {"p90": ordered[53], "p99": ordered[59], "p100": ordered[59]}
    assert store.chat["lengths"] == fit


def test_the_run_names_the_seq_len_that_fits_the_conversations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer, template = Tokenizer.from_file(TOKENIZER), ChatTemplate.for_tokenizer(TOKENIZER)
    lengths = sorted(len(encode_conversation(m, template, tokenizer)[0]) for m in conversations())
    # Of 60 conversations, 99% is all of them: said once.
    fit = f": training.seq_len {lengths[-1]} fits all of them, {lengths[53]} fits 90%"
    longer = sum(n > 64 for n in lengths)
    for seq_len, cut, hint in ((64, longer, fit), (lengths[-1], 0, "")):
        args = ("--data.train_path", str(CHAT), "--training.seq_len", str(seq_len))
        make_trainer(tmp_path / str(seq_len), *args)
        line = (
            f"data.train_path '{CHAT}': 60 conversations; {cut} longer than {seq_len} tokens "
            f"truncated, 0 dropped (data.chat_overlong){hint}\n"
        )
        assert line in capsys.readouterr().err


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_records_and_mixed_inputs_are_refused_naming_file_and_line(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}]}
    bad = _write(
        tmp_path / "bad.jsonl", [good, good, {"messages": [{"role": "bot", "content": ""}]}]
    )
    with pytest.raises(DataError, match=r"bad\.jsonl' line 3: message 0 has role 'bot'"):
        prepare([str(bad)], tmp_path / "out", TOKENIZER, workers=1, progress=False)
    text = _write(tmp_path / "text.jsonl", [{"text": "hi"}])
    with pytest.raises(DataError, match=r"inputs mix chat data .*bad\.jsonl\) with text"):
        prepare([str(bad), str(text)], tmp_path / "out", TOKENIZER, workers=1, progress=False)
    with pytest.raises(DataError, match=r"text\.jsonl' line 1 has no 'messages'"):
        prepare(
            [str(text)],
            tmp_path / "out",
            TOKENIZER,
            workers=1,
            progress=False,
            chat=ChatOptions("chat"),
        )


def test_the_run_refuses_a_bad_record_before_step_one(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}]}
    bad = _write(tmp_path / "bad.jsonl", [good, {"messages": []}])
    with pytest.raises(DataError) as refused:
        make_trainer(tmp_path / "run", "--data.train_path", str(bad))
    fix = '{"messages": [{"role": ..., "content": "..."}, ...]}'
    assert str(refused.value) == f"input '{bad}' line 2: 'messages' is empty: give {fix}"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@torch.no_grad()
def test_packed_conversations_under_document_masking_each_get_their_loss_alone(
    tmp_path: Path,
) -> None:
    """Two conversations packed into one row, with what chat data defaults to (document
    masking and per-document positions): each one's assistant-only loss is its loss alone. The
    boundary is the store's ``.idx``, though the default template ends every turn with EOS."""
    two = _write(tmp_path / "two.jsonl", [{"messages": m} for m in conversations()[:2]])
    folder = prepare([str(two)], tmp_path / "out", TOKENIZER, workers=1, progress=False).folder
    store, eos = TokenStore(folder), Tokenizer.from_file(TOKENIZER).eos_id
    first = int(document_offsets(folder, 0)[0])
    assert (store.read(0, first) == eos).sum() > 1  # EOS boundaries would split a conversation
    width = store.num_tokens - 1  # one sample: both conversations
    batch = PackedDataset(store, width, documents=True, positions=True, loss_mask=True).collate([0])
    assert batch.documents[0].tolist() == [0] * first + [1] * (width - first)
    args = dataclasses.replace(
        FLAVORS["tiny"], vocab_size=2048, max_seq_len=store.num_tokens, attention="document"
    )
    model = Transformer(args)
    model.init_weights(seed=0)
    packed = model(batch.inputs, **batch.model_inputs())
    causal = model(batch.inputs)  # the negative control: the second one sees the first
    for i, span in enumerate(document_spans(batch.documents[0])):
        ids = store.read(span.start, span.stop - span.start + 1)
        tokens = torch.from_numpy(ids.astype(np.int64))
        counted = torch.from_numpy(store.read_mask(span.start + 1, len(tokens) - 1)).bool()
        alone_targets = tokens[1:].masked_fill(~counted, IGNORE_INDEX)[None]
        assert alone_targets.equal(batch.targets[:, span])  # the boundary's target is not counted
        alone = cross_entropy(model(tokens[None, :-1]), alone_targets)
        mine = cross_entropy(packed[:, span], batch.targets[:, span])
        assert abs(mine - alone) < 1e-5
        error = (causal[:, span] - packed[:, span]).abs().max()
        assert error < 1e-5 if i == 0 else error > 1e-2


def test_chat_training_data_resolves_auto_attention_to_document_masking() -> None:
    """``auto`` follows the data; a value the user set stays, and reset_positions follows."""
    for attention, chat, expected in (
        ("auto", True, "document"),
        ("auto", False, "causal"),
        ("causal", True, "causal"),
        ("document", False, "document"),
    ):
        config = JobConfig(model=ModelConfig(attention=attention))
        config.resolve_attention(chat=chat)
        assert (config.model.attention, config.data.reset_positions) == (
            expected,
            expected == "document",
        )
    assert JobConfig().model.attention == "auto"  # unresolved until the data is read


@pytest.mark.parametrize(
    ("trained", "validated"), [("chat", "text"), ("text", "chat"), ("chat", "chat")]
)
def test_validation_data_of_another_kind_than_the_training_data_is_said_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trained: str, validated: str
) -> None:
    paths = {"chat": str(CHAT), "text": str(SAMPLE / "validation.jsonl")}
    args = ("--data.train_path", paths[trained], "--data.validation_path", paths[validated])
    make_trainer(tmp_path / "run", *args, "--validation.interval", "1")
    warned = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    if trained == validated:
        assert warned == []
        return
    sample = {"chat": "sample:chat_validation.jsonl", "text": "sample:validation.jsonl"}
    assert len(warned) == 1 and warned[0].endswith(
        f"WARNING data.validation_path '{paths[validated]}' is {validated} data but the "
        f"training data is {trained}: its loss is not the trained task's and may rise while "
        f"the training loss falls; set data.validation_path to {trained} data (the sample's: "
        f"{sample[trained]})"
    ), warned
