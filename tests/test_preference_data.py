"""Preference data (TRL's conversational format): detected, rendered as chat data is, packed
as adjacent chosen/rejected documents that never cross a sample, and bad records refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plugtrain.data import MixtureDataset, PackedDataset
from plugtrain.data.chat import ChatOptions, ChatTemplate, encode_conversation
from plugtrain.data.prepare import prepare
from plugtrain.data.store import TokenStore
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError
from plugtrain.testing import SAMPLE, make_trainer, setup_context

TOKENIZER = SAMPLE / "tokenizer.json"
PROMPT = [{"role": "user", "content": "Reverse 'moon'."}]
GOOD = {
    "prompt": PROMPT,
    "chosen": [{"role": "assistant", "content": "'noom'."}],
    "rejected": [{"role": "assistant", "content": "'moon' has 4 letters."}],
}


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepare(tmp_path: Path, path: Path, seq_len: int, overlong: str = "truncate") -> TokenStore:
    out = tmp_path / f"out_{seq_len}_{overlong}"
    chat = ChatOptions(max_tokens=seq_len, overlong=overlong)
    prepare([str(path)], out, str(TOKENIZER), workers=1, progress=False, chat=chat)
    return TokenStore(out)


def test_the_sample_is_what_its_script_writes(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_preference_sample.py"
    subprocess.run([sys.executable, script, "--out", tmp_path], check=True)
    for name in ("preference_train.jsonl", "preference_validation.jsonl"):
        assert (tmp_path / name).read_bytes() == (SAMPLE / name).read_bytes()


def test_pairs_are_adjacent_documents_that_never_cross_a_sample(tmp_path: Path) -> None:
    seq_len = 256
    store = _prepare(tmp_path, SAMPLE / "preference_train.jsonl", seq_len)
    assert store.chat["preference"] and store.chat["conversations"] == 600
    assert store.num_tokens % (seq_len + 1) == 0  # whole bins
    data = PackedDataset(store, seq_len, documents=True, loss_mask=True)
    pairs = []
    for i in range(len(data)):
        docs, counted = data.sample_documents(i), data.counted(i)
        tokens = data.tokens(i)
        per_doc = [int(counted[docs == d].sum()) for d in range(docs.max() + 1)]
        # chosen (even), rejected (odd), each with completion tokens; a padding doc at the end
        n = len(per_doc) // 2 * 2
        assert all(c > 0 for c in per_doc[:n]), per_doc
        assert per_doc[n:] in ([], [0])
        pairs.append(n // 2)
        # the two sides start with the same prompt
        starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        for k in range(0, n, 2):
            c, r = tokens[starts[k] :], tokens[starts[k + 1] :]
            assert (c[:5] == r[:5]).all()
    assert sum(pairs) == 600 and len(set(pairs)) > 1  # unequal pairs per sample


def test_numbered_samples_find_their_pairs_documents_in_the_store(tmp_path: Path) -> None:
    """SetupContext.number_samples numbers the run's datasets one after the other; a row's
    number finds the store's documents of its pairs again (over shards), and the mixture of
    the datasets carries the same numbers."""
    seq_len, width = 256, 257
    out = tmp_path / "pairs"
    chat = ChatOptions(max_tokens=seq_len)
    prepare([str(SAMPLE / "preference_train.jsonl")], out, str(TOKENIZER), workers=1,
            progress=False, chat=chat, shard_tokens=5000, chunk_bytes=8192)  # fmt: skip
    store = TokenStore(out)
    assert len(store.manifest["shards"]) > 2
    train = PackedDataset(store, seq_len, documents=True, loss_mask=True)
    held_out = PackedDataset(store, seq_len, documents=True)
    assert train.collate([3]).samples is None  # unless asked for
    ctx = dataclasses.replace(setup_context(), datasets=(train, held_out))
    assert ctx.number_samples() == (train, held_out)
    assert train.collate([3, 1]).samples.tolist() == [3, 1]
    assert held_out.collate([2]).samples.tolist() == [len(train) + 2]
    firsts = train.first_documents(np.arange(len(train)))
    assert firsts[0] == 0 and np.all(np.diff(firsts) > 0)
    assert [store.document_span(int(f))[0] for f in firsts] == list(
        range(0, len(train) * width, width)
    )
    for i in (0, 1, len(train) // 2, len(train) - 1):
        first, docs = firsts[i], train.sample_documents(i)
        for d in range(docs.max() + 1):
            start, end = store.document_span(int(first) + d)
            assert start == i * width + np.flatnonzero(docs == d)[0]
            assert end <= (i + 1) * width
    mixture = MixtureDataset([train, held_out], [1, 1], ["a", "b"], seed=0)
    sources, indices = mixture.locate(range(8))
    numbers = [i + (len(train) if s else 0) for s, i in zip(sources, indices, strict=True)]
    assert mixture.collate(range(8)).samples.tolist() == numbers


def test_a_side_is_the_chat_rendering_of_prompt_and_completion_masked_on_the_completion(
    tmp_path: Path,
) -> None:
    # A multi-turn prompt: its own assistant turn counts for neither side.
    prompt = [*PROMPT, {"role": "assistant", "content": "'noom'."},
              {"role": "user", "content": "Again?"}]  # fmt: skip
    record = {**GOOD, "prompt": prompt}
    implicit = {"chosen": prompt + GOOD["chosen"], "rejected": prompt + GOOD["rejected"]}
    stores = [
        _prepare(tmp_path / name, _write(tmp_path / f"{name}.jsonl", [r]), 128)
        for name, r in (("explicit", record), ("implicit", implicit))
    ]
    template, tokenizer = ChatTemplate.for_tokenizer(TOKENIZER), Tokenizer.from_file(TOKENIZER)
    ids, mask = encode_conversation(prompt + GOOD["chosen"], template, tokenizer)
    whole_mask = mask.copy()
    mask[: len(encode_conversation(prompt, template, tokenizer)[0])] = 0
    assert whole_mask.sum() > mask.sum() > 0
    for store in stores:
        assert store.read(0, len(ids)).tolist() == ids
        assert store.read_mask(0, len(ids)).tolist() == mask.tolist()


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": PROMPT, "chosen": GOOD["chosen"]}, "has no 'rejected' (preference data)"),
        ({**GOOD, "chosen": []}, "'chosen' is empty"),
        (
            {**GOOD, "rejected": [{"role": "assistant", "content": ""}]},
            "the 'rejected' completion is empty: give the reply",
        ),
        ({**GOOD, "rejected": GOOD["chosen"]}, "'chosen' equals 'rejected': a pair must differ"),
        (
            {**GOOD, "prompt": [*PROMPT, GOOD["chosen"][0]]},
            "the prompt ends with a 'assistant' message: it must end with the user's turn",
        ),
        (
            {"chosen": GOOD["chosen"], "rejected": GOOD["rejected"]},
            "'chosen' and 'rejected' share no prompt message",
        ),
    ],
)
def test_a_bad_pair_is_refused_in_one_line_naming_file_and_line(
    tmp_path: Path, record: dict, message: str
) -> None:
    bad = _write(tmp_path / "bad.jsonl", [GOOD, record])
    with pytest.raises(DataError) as refused:
        _prepare(tmp_path, bad, 128)
    assert f"input '{bad}' line 2" in str(refused.value) and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_overlong_pair_is_cut_or_dropped_as_chat_data_is(tmp_path: Path) -> None:
    long = {**GOOD, "rejected": [{"role": "assistant", "content": "no " * 60}]}
    path = _write(tmp_path / "long.jsonl", [GOOD, long])
    # GOOD's sides are 34 and 40 tokens, long's rejected side 90: a bin of 81 cuts it to 47.
    cut = _prepare(tmp_path, path, 80)
    assert (cut.chat["truncated"], cut.chat["dropped"]) == (1, 0)
    assert cut.num_tokens == 2 * 81
    dropped = _prepare(tmp_path, path, 80, overlong="drop")
    assert (dropped.chat["truncated"], dropped.chat["dropped"]) == (0, 1)
    assert dropped.chat["conversations"] == 2 and dropped.num_tokens == 81


def test_preference_data_without_a_loss_plugin_is_refused_before_step_one(tmp_path) -> None:
    with pytest.raises(DataError, match="no enabled plugin answers their loss: enable the 'dpo'"):
        make_trainer(
            tmp_path,
            *("--data.train_path", str(SAMPLE / "preference_train.jsonl")),
            *("--training.seq_len", "256"),
        )
    assert not (tmp_path / "metrics.jsonl").exists()


def test_pairs_all_too_long_for_the_sequence_are_refused_naming_a_seq_len_that_fits(tmp_path):
    path = _write(tmp_path / "pairs.jsonl", [GOOD, GOOD])
    with pytest.raises(DataError) as refused:
        _prepare(tmp_path, path, 32)
    assert str(refused.value).endswith(
        "all 2 conversations or pairs are too long for 32 tokens and were dropped: "
        "training.seq_len 74 fits all of them"
    )
