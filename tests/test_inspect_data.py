"""``plugtrain inspect-data``: the examples it shows are those training reads (rows against the
run's own data path, a file's against its prepared folder), the trained tokens marked as a
hand-written rendering says, colour on a terminal, and each bad input one line and exit 2."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from plugtrain.cli import main
from plugtrain.data import (
    IGNORE_INDEX,
    ChatOptions,
    PackedDataset,
    Tokenizer,
    document_examples,
    open_token_store,
    read_head,
    row_examples,
)
from plugtrain.data.chat import ChatTemplate, encode_conversation
from plugtrain.data.prepare import prepare
from plugtrain.data.store import TokenStore
from plugtrain.testing import SAMPLE, build_dataset

TOKENIZER = SAMPLE / "tokenizer.json"
CHAT = SAMPLE / "chat_train.jsonl"
REPLY = "Hello there."


def write_chat(path: Path, replies: list[str]) -> Path:
    lines = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": r}]}
        for r in replies
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_conversation_is_shown_with_its_reply_trained(tmp_path, capsys):
    chat = write_chat(tmp_path / "chat.jsonl", [REPLY])
    assert main(["inspect-data", str(chat), "--color", "never"]) == 0
    out = capsys.readouterr().out.splitlines()
    # The default template written out: the reply and its end of turn are the assistant's.
    prompt = "<|begin_of_text|><|user|>\nHi<|end_of_text|>\n<|assistant|>\n"
    reply = f"{REPLY}<|end_of_text|>\n"
    tokenizer = Tokenizer.from_file(TOKENIZER)
    before, after = tokenizer.encode(prompt), tokenizer.encode(reply)
    assert tokenizer.encode(prompt + reply) == before + after  # split where the reply starts
    sha = ChatTemplate.for_tokenizer(TOKENIZER).sha256
    numbers = " ".join(map(str, before)) + " [[" + " ".join(map(str, after)) + "]]"
    assert out == [
        f"{chat}: chat data, template plugtrain's default chat template (sha256 {sha[:12]})",
        "of 1 conversations read, 0 cut at 128 tokens and 0 dropped (data.chat_overlong)",
        "trained (data.chat_loss assistant): the assistant's tokens, between [[ and ]]",
        "",
        f"--- document 0: {len(before + after)} tokens, {len(after)} trained ---",
        *f"{prompt}[[{reply}]]".splitlines(),
        f"ids: {numbers}",
    ]


def test_colour_marks_them_on_a_terminal_and_brackets_elsewhere(tmp_path, capsys, monkeypatch):
    chat = str(write_chat(tmp_path / "chat.jsonl", [REPLY]))
    shown = {}
    for name, argv, terminal, no_color in [
        ("pipe", [], False, ""),
        ("terminal", [], True, ""),
        ("NO_COLOR", [], True, "1"),
        ("always", ["--color", "always"], False, ""),
    ]:
        monkeypatch.setattr(sys.stdout, "isatty", lambda terminal=terminal: terminal)
        monkeypatch.setenv("NO_COLOR", no_color)
        assert main(["inspect-data", chat, *argv]) == 0
        shown[name] = capsys.readouterr().out
    assert f"[[{REPLY}" in shown["pipe"] and "\x1b" not in shown["pipe"]
    assert shown["NO_COLOR"] == shown["pipe"]
    assert shown["terminal"] == shown["always"]
    heading, body = shown["always"].split("\n\n")
    assert heading.endswith("the assistant's tokens, \x1b[1;32min green\x1b[0m")
    assert body == shown["pipe"].split("\n\n")[1].replace("[[", "\x1b[1;32m").replace(
        "]]", "\x1b[0m"
    )


def test_a_file_shows_the_rows_the_run_reads(tmp_path):
    # The run's own path: the file prepared into the cache, its rows masked by the loader.
    seq_len = 64
    chat = ChatOptions(max_tokens=seq_len)
    store = open_token_store(CHAT, "data.train_path", TOKENIZER, "text", chat=chat)
    batch = PackedDataset(store, seq_len, loss_mask=True).collate(range(6))
    head = read_head([str(CHAT)], TOKENIZER, chat=chat, min_tokens=6 * (seq_len + 1))
    assert head.num_tokens < store.num_tokens  # only the head was read
    shown = row_examples(head, seq_len, 0, 6)
    assert [e.name for e in shown] == [f"row {i}" for i in range(6)]
    ids = np.stack([e.ids for e in shown]).astype(np.int64)
    trained = np.stack([e.trained for e in shown])
    assert (ids[:, :-1] == batch.inputs.numpy()).all()
    assert (trained[:, 1:] == (batch.targets != IGNORE_INDEX).numpy()).all()
    assert (ids[:, 1:][trained[:, 1:]] == batch.targets.numpy()[trained[:, 1:]]).all()
    assert 0 < trained.sum() < trained.size and not trained[:, 0].any()
    # The prepared folder's rows, and with data.chat_loss "all" every target is trained.
    assert [e.ids.tolist() for e in row_examples(store, seq_len, 0, 6)] == ids.tolist()
    assert all(e.trained[1:].all() for e in row_examples(head, seq_len, 0, 6, loss_mask=False))


def test_text_rows_are_the_reference_packing_all_trained():
    tokenizer = Tokenizer.from_file(TOKENIZER)
    reference = build_dataset(SAMPLE / "validation.jsonl", "x", tokenizer, "text", 32)
    head = read_head([str(SAMPLE / "validation.jsonl")], TOKENIZER, min_tokens=3 * 33)
    shown = row_examples(head, 32, 1, 2)
    assert [e.ids.tolist() for e in shown] == [reference.tokens(i).tolist() for i in (1, 2)]
    assert [e.trained.tolist() for e in shown] == [[False] + [True] * 32] * 2


def test_a_file_and_its_prepared_folder_show_the_same_documents(tmp_path, capsys):
    # Conversations longer than --seq-len dropped: the documents are the kept ones, in order.
    seq_len = 60
    options = ["--seq-len", str(seq_len), "--chat-overlong", "drop"]
    chat = ChatOptions(max_tokens=seq_len, overlong="drop")
    folder = tmp_path / "prepared"
    prepare([str(CHAT)], folder, TOKENIZER, workers=1, progress=False, chat=chat)
    head = read_head([str(CHAT)], TOKENIZER, chat=chat, min_documents=4)
    ours, theirs = document_examples(head, 1, 3), document_examples(TokenStore(folder), 1, 3)
    assert [(e.ids.tolist(), e.trained.tolist()) for e in ours] == [
        (e.ids.tolist(), e.trained.tolist()) for e in theirs
    ]
    kept = []
    tokenizer, template = Tokenizer.from_file(TOKENIZER), ChatTemplate.for_tokenizer(TOKENIZER)
    for line in CHAT.read_text().splitlines():
        ids, mask = encode_conversation(json.loads(line)["messages"], template, tokenizer)
        if len(ids) <= seq_len:
            kept.append((ids, mask.astype(bool).tolist()))
        if len(kept) == 4:
            break
    assert [(e.ids.tolist(), e.trained.tolist()) for e in ours] == kept[1:]
    # Through the command: the same examples, and the counts read said.
    assert main(["inspect-data", str(CHAT), *options, "--skip", "1"]) == 0
    from_file = capsys.readouterr().out.split("\n\n", 1)
    assert main(["inspect-data", str(folder), "--skip", "1"]) == 0
    from_folder = capsys.readouterr().out.split("\n\n", 1)
    assert from_file[1] == from_folder[1] and from_file[1].count("--- document") == 3
    dropped = len(CHAT.read_text().splitlines()) - TokenStore(folder).num_documents
    assert "and 0 dropped" not in from_folder[0] and f"and {dropped} dropped" in from_folder[0]


def test_a_store_finds_each_document_across_its_shards(tmp_path):
    chat = SAMPLE / "chat_validation.jsonl"
    prepare([str(chat)], tmp_path / "p", TOKENIZER, workers=1, shard_tokens=500, chunk_bytes=2000)
    store = TokenStore(tmp_path / "p")
    assert len(store.manifest["shards"]) > 2
    numbered = store.documents(0, store.num_tokens)
    spans = [store.document_span(i) for i in range(store.num_documents)]
    assert spans == [
        (int(np.argmax(numbered == i)), int(np.sum(numbered <= i))) for i in range(numbered[-1] + 1)
    ]
    with pytest.raises(IndexError):
        store.document_span(store.num_documents)


def folder_with_chat(tmp_path: Path) -> str:
    chat = write_chat(tmp_path / "chat.jsonl", [REPLY, "Good day."])
    prepare([str(chat)], tmp_path / "prepared", TOKENIZER, workers=1, progress=False)
    return str(tmp_path / "prepared")


def other_tokenizer(tmp_path: Path) -> str:
    """The sample's tokenizer written again: the same vocabulary, another file (sha256)."""
    path = tmp_path / "other" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(json.loads(TOKENIZER.read_text()), indent=1))
    return str(path)


BAD = [
    (lambda t: ["nope.jsonl"], "input 'nope.jsonl' not found: give a prepared folder or a data"),
    (lambda t: [str(write_chat(t / "c.jsonl", ["a"])), "-n", "0"], "-n must be >= 1, got 0"),
    (
        lambda t: [str(write_chat(t / "c.jsonl", ["a", "b"])), "--skip", "2"],
        r"input '.*c\.jsonl' has 2 documents: --skip 2 leaves none to show; lower --skip",
    ),
    (
        lambda t: [
            str(write_chat(t / "c.jsonl", ["a", "b"])),
            "--rows",
            "--seq-len",
            "8",
            "--skip",
            "100",
        ],
        r"input '.*c\.jsonl' has \d+ rows of seq_len=8: --skip 100 leaves none to show",
    ),
    (
        lambda t: [folder_with_chat(t), "--chat-template", "x.jinja"],
        r"--chat-template applies to a data file, but '.*prepared' is a prepared folder",
    ),
    (
        lambda t: [folder_with_chat(t), "--tokenizer", other_tokenizer(t)],
        r"--tokenizer '.*other/tokenizer\.json' is not the tokenizer '.*prepared' was prepared",
    ),
    (lambda t: [str(t)], r"input '.*' has no manifest\.json: it is not a prepared folder"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main(["inspect-data", *argv(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("plugtrain: error: ") and re.search(message, err), err
