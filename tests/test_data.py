"""Tests of plugtrain.data.pipeline (packing, the batch loaders) and of the kit's in-memory
reference path (JSONL loading, tokenization)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models

from plugtrain.data.permutation import permute
from plugtrain.data.pipeline import (
    MicroBatch,
    PackedDataset,
    StatefulBatchLoader,
    count_eval_batches,
    iter_eval_batches,
)
from plugtrain.data.prefetch import DevicePrefetcher
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError
from plugtrain.testing import (
    SAMPLE,
    InMemoryStream,
    build_dataset,
    load_jsonl_texts,
    tokenize_documents,
)

SEQ_LEN = 3


# --- load_jsonl_texts ---------------------------------------------------------------------


def _jsonl(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text(content, encoding="utf-8")
    return path


def test_load_jsonl_texts_reads_field_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, '{"text": "a\\nb", "title": "x"}\n\n{"text": ""}\n{"text": "é"}\n\n')
    assert load_jsonl_texts(path) == ["a\nb", "", "é"]


def test_load_jsonl_texts_other_field(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, '{"body": "one"}\n{"body": "two"}\n')
    assert load_jsonl_texts(path, field="body") == ["one", "two"]


def test_load_jsonl_texts_missing_file_names_path_and_key(tmp_path: Path) -> None:
    path = tmp_path / "missing.jsonl"
    msg = f"data file '{path}' not found: set data.validation_path to a JSONL file"
    with pytest.raises(FileNotFoundError, match=re.escape(msg)):
        load_jsonl_texts(path, key="data.validation_path")


def test_load_jsonl_texts_bad_json_names_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, '{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(ValueError, match=re.escape(f"data file '{path}' line 3 is not valid JSON")):
        load_jsonl_texts(path)


def test_load_jsonl_texts_bad_utf8_names_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_jsonl_texts(path)


@pytest.mark.parametrize("line", ['{"title": "x"}', '["text"]', '{"text": 3}'])
def test_load_jsonl_texts_missing_field_names_line_and_field(tmp_path: Path, line: str) -> None:
    path = _jsonl(tmp_path, f'{{"text": "a"}}\n{line}\n')
    msg = f"data file '{path}' line 2 is not a JSON object with a string field 'text'"
    with pytest.raises(ValueError, match=re.escape(msg)):
        load_jsonl_texts(path)


def test_load_jsonl_texts_empty_file(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, "\n  \n")
    with pytest.raises(ValueError, match=re.escape(f"data file '{path}' holds no documents")):
        load_jsonl_texts(path)


# --- tokenize_documents -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(SAMPLE / "tokenizer.json")


def test_tokenize_documents_frames_each_document(tok: Tokenizer) -> None:
    docs = ["Enter Hamlet.", "", "Exeunt."]
    stream = tokenize_documents(docs, tok)
    expected = []
    for doc in docs:
        expected += [tok.bos_id, *tok.encode(doc), tok.eos_id]
    assert stream.dtype == torch.int32 and stream.dim() == 1
    assert stream.tolist() == expected
    assert tok.decode(stream.tolist()) == "".join(
        f"<|begin_of_text|>{d}<|end_of_text|>" for d in docs
    )


def test_tokenize_documents_without_bos(tmp_path: Path) -> None:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.add_special_tokens(["<|end_of_text|>"])
    raw.save(str(tmp_path / "t.json"))
    stream = tokenize_documents(["", ""], Tokenizer.from_file(tmp_path / "t.json"))
    assert stream.tolist() == [0, 0]


# --- PackedDataset ------------------------------------------------------------------------


def test_packed_dataset_targets_are_shifted_inputs() -> None:
    ds = PackedDataset(InMemoryStream(torch.arange(23, dtype=torch.int32)), seq_len=4)
    assert len(ds) == 4  # 23 // 5; the last 3 tokens are dropped
    for i in range(len(ds)):
        inputs, targets = ds[i]
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.tolist() == list(range(5 * i, 5 * i + 4))
        assert targets.tolist() == list(range(5 * i + 1, 5 * i + 5))
    inputs, targets, documents, positions, samples = ds.collate([3, 0])
    assert documents is positions is samples is None  # unless asked for
    assert torch.equal(inputs, torch.stack([ds[3][0], ds[0][0]]))
    assert torch.equal(targets, torch.stack([ds[3][1], ds[0][1]]))
    with pytest.raises(IndexError, match="sample index 4 out of range for 4 samples"):
        ds[4]


def test_packed_dataset_too_short_stream() -> None:
    msg = r"the token stream has 4 tokens, fewer than the 5 needed .* seq_len=4"
    with pytest.raises(DataError, match=msg):
        PackedDataset(InMemoryStream(torch.arange(4)), seq_len=4)
    with pytest.raises(DataError, match=r"training\.seq_len must be >= 1, got 0"):
        PackedDataset(InMemoryStream(torch.arange(4)), seq_len=0)


def test_build_dataset_names_a_file_too_small_for_one_sample(tmp_path: Path, tok: Tokenizer):
    path = _jsonl(tmp_path, '{"text": "Exeunt."}\n')
    msg = f"data.validation_path '{path}' has 4 tokens, fewer than the 33 needed"
    with pytest.raises(DataError, match=re.escape(msg)):
        build_dataset(path, "data.validation_path", tok, "text", 32)


def test_build_dataset_packs_the_validation_split(tok: Tokenizer) -> None:
    path = SAMPLE / "validation.jsonl"
    stream = tokenize_documents(load_jsonl_texts(path), tok)
    ds = build_dataset(path, "data.validation_path", tok, "text", 128)
    assert len(ds) == stream.numel() // 129
    assert torch.equal(ds[1][0], stream[129:257].long())
    assert ds[0][0][0].item() == tok.bos_id
    with pytest.raises(ValueError, match=r"line 1 is not a JSON object with a string field 'body'"):
        build_dataset(path, "data.validation_path", tok, "body", 128)


# --- StatefulBatchLoader ------------------------------------------------------------------


def _dataset(num_samples: int) -> PackedDataset:
    """Sample i holds tokens i*(SEQ_LEN+1) ..., so its id is inputs[0] // (SEQ_LEN+1)."""
    return PackedDataset(InMemoryStream(torch.arange(num_samples * (SEQ_LEN + 1))), seq_len=SEQ_LEN)


def _ids(batch: MicroBatch) -> list[int]:
    inputs, targets = batch.inputs, batch.targets
    assert inputs.shape == targets.shape and inputs.shape[1] == SEQ_LEN
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    return (inputs[:, 0] // (SEQ_LEN + 1)).tolist()


def _loaders(ds: PackedDataset, world_size: int, grad_accum: int, **kw) -> list:
    kw = {"global_batch_size": 8, "seed": 0, **kw}
    return [
        StatefulBatchLoader(ds, grad_accum_steps=grad_accum, rank=rank, world_size=world_size, **kw)
        for rank in range(world_size)
    ]


def _global_step(loaders: list[StatefulBatchLoader]) -> list[int]:
    """Sample ids of one step over all ranks, rank-major then microbatch order."""
    ids = []
    for loader in loaders:
        microbatches = loader.next_batch()
        assert len(microbatches) == loader.grad_accum_steps
        for mb in microbatches:
            assert mb[0].shape[0] == loader.micro_batch_size
            ids += _ids(mb)
    return ids


@pytest.mark.parametrize(("world_size", "grad_accum"), [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_loader_union_equals_single_rank_batch(world_size: int, grad_accum: int) -> None:
    ds = _dataset(20)  # 2 steps of 8 per epoch, 4 samples dropped: steps cross epochs
    reference = _loaders(ds, 1, 1)
    split = _loaders(ds, world_size, grad_accum)
    for _ in range(5):
        expected = _global_step(reference)
        assert _global_step(split) == expected
        states = {tuple(loader.state_dict().items()) for loader in split}
        assert states == {tuple(reference[0].state_dict().items())}


def test_loader_is_deterministic_per_seed() -> None:
    ds = _dataset(64)
    a, b, c = (_loaders(ds, 1, 1, seed=seed)[0] for seed in (7, 7, 8))
    steps_a = [_global_step([a]) for _ in range(4)]
    assert steps_a == [_global_step([b]) for _ in range(4)]
    assert steps_a != [_global_step([c]) for _ in range(4)]


def test_loader_epochs_are_distinct_permutations() -> None:
    ds = _dataset(16)
    loader = _loaders(ds, 1, 1, global_batch_size=4)[0]
    epochs = [[i for _ in range(4) for i in _global_step([loader])] for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(16))  # each sample exactly once per epoch
    assert len({tuple(order) for order in epochs}) == 3
    assert epochs[0] != list(range(16))
    assert loader.state_dict() == {"epoch": 2, "position": 16}


def test_loader_drops_epoch_remainder_and_unshuffled_order() -> None:
    loader = _loaders(_dataset(11), 1, 1, global_batch_size=4, shuffle=False)[0]
    assert [_global_step([loader]) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert loader.state_dict() == {"epoch": 1, "position": 4}


@pytest.mark.parametrize(("resume_world", "resume_accum"), [(2, 2), (1, 1), (4, 1)])
def test_loader_resume_continues_the_same_sequence(resume_world: int, resume_accum: int) -> None:
    ds = _dataset(20)
    uninterrupted = _loaders(ds, 2, 2)
    for _ in range(3):
        _global_step(uninterrupted)
    state = uninterrupted[0].state_dict()

    interrupted = _loaders(ds, 2, 2)
    for _ in range(3):
        _global_step(interrupted)
    assert [loader.state_dict() for loader in interrupted] == [state, state]
    resumed = _loaders(ds, resume_world, resume_accum)
    for loader in resumed:
        loader.load_state_dict(dict(state))
    for _ in range(4):
        assert _global_step(resumed) == _global_step(uninterrupted)


def test_loader_load_state_dict_validates() -> None:
    loader = _loaders(_dataset(20), 1, 1)[0]
    with pytest.raises(DataError, match=r"has keys \['epoch'\], expected \['epoch', 'position'\]"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="out of range for the 20 samples of the token stream"):
        loader.load_state_dict({"epoch": 0, "position": 21})
    with pytest.raises(DataError, match="must hold two ints"):
        loader.load_state_dict({"epoch": 0, "position": 1.5})
    assert loader.state_dict() == {"epoch": 0, "position": 0}  # untouched by failed loads


def test_loader_batch_size_not_divisible() -> None:
    msg = (
        "training.batch_size=6 is not a positive multiple of world_size * grad_accum_steps "
        "= 2 * 2 = 4: set training.batch_size to a multiple of 4"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        _loaders(_dataset(20), 2, 2, global_batch_size=6)


def test_loader_batch_larger_than_dataset() -> None:
    msg = r"training\.batch_size=8 exceeds the 5 training samples of seq_len=3 in the token stream"
    with pytest.raises(DataError, match=msg):
        _loaders(_dataset(5), 1, 1)


# --- iter_eval_batches --------------------------------------------------------------------


def test_eval_batches_split_across_ranks_in_order() -> None:
    ds = _dataset(13)
    single = [_ids(b) for b in iter_eval_batches(ds, batch_size=4, rank=0, world_size=1)]
    assert single == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # sample 12 dropped
    per_rank = [
        [_ids(b) for b in iter_eval_batches(ds, batch_size=4, rank=r, world_size=2)]
        for r in range(2)
    ]
    assert [a + b for a, b in zip(*per_rank, strict=True)] == single
    limited = iter_eval_batches(ds, batch_size=4, rank=1, world_size=2, max_batches=2)
    assert [_ids(b) for b in limited] == [[2, 3], [6, 7]]


def test_eval_batches_errors() -> None:
    ds = _dataset(3)
    with pytest.raises(DataError, match="eval batch size 3 is not a positive multiple of world"):
        iter_eval_batches(ds, batch_size=3, rank=0, world_size=2)
    msg = (
        "the token stream has 3 samples of seq_len=3, fewer than one validation batch of "
        "training.batch_size=4: lower training.batch_size or training.seq_len, or use a larger "
        "validation file"
    )
    with pytest.raises(DataError, match=re.escape(msg)):
        iter_eval_batches(ds, batch_size=4, rank=0, world_size=2)
    with pytest.raises(DataError, match=re.escape(msg)):
        count_eval_batches(ds, batch_size=4, world_size=1)
    assert count_eval_batches(_dataset(13), batch_size=4, world_size=2) == 3
    assert count_eval_batches(_dataset(13), batch_size=4, world_size=2, max_batches=2) == 2
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        iter_eval_batches(ds, batch_size=2, rank=2, world_size=2)


def test_prefetcher_resumes_with_the_next_batch_not_the_prefetched_one():
    (loader,) = _loaders(_dataset(40), world_size=1, grad_accum=1)
    batches = DevicePrefetcher(loader, torch.device("cpu"))
    first = _ids(batches.next_batch()[0])
    batches.prefetch()  # the second step's batch, drawn ahead
    state = batches.state_dict()
    second = _ids(batches.next_batch()[0])
    (fresh,) = _loaders(_dataset(40), world_size=1, grad_accum=1)
    resumed = DevicePrefetcher(fresh, torch.device("cpu"))
    resumed.load_state_dict(state)
    assert _ids(resumed.next_batch()[0]) == second != first


# --- permutation --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_permute_is_a_bijection_of_range_n(n: int) -> None:
    order = permute(np.arange(n), n, seed=3, epoch=1)
    assert sorted(order.tolist()) == list(range(n))
    # Any slice gives the same values as the whole (the loader computes only its slice).
    assert permute(np.arange(n // 2, n), n, seed=3, epoch=1).tolist() == order[n // 2 :].tolist()


def test_permute_depends_on_seed_and_epoch_only() -> None:
    n = 1000
    first = permute(np.arange(n), n, seed=0, epoch=0)
    assert permute(np.arange(n), n, seed=0, epoch=0).tolist() == first.tolist()
    assert permute(np.arange(n), n, seed=0, epoch=1).tolist() != first.tolist()
    assert permute(np.arange(n), n, seed=1, epoch=0).tolist() != first.tolist()
    assert first.tolist() != list(range(n))


def test_permute_of_two_billion_samples_is_instant() -> None:
    n = 2_000_000_000  # torch.randperm would take 16 GB and minutes
    start = time.perf_counter()
    order = permute(np.arange(4096), n, seed=0)
    assert time.perf_counter() - start < 0.5
    assert order.min() >= 0 and order.max() < n and len(set(order.tolist())) == 4096
