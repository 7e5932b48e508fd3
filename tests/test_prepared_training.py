"""Training on prepared folders: the same samples as from the JSONL they came from, the
JSONL cache, exact resume, world-size independent batches, and a tokenizer mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plugtrain.data.cache import cache_folder
from plugtrain.data.pipeline import PackedDataset, StatefulBatchLoader
from plugtrain.data.prepare import prepare
from plugtrain.data.store import MANIFEST, TokenStore, file_sha256
from plugtrain.testing import SAMPLE, interrupted_and_resumed, make_trainer, read_metrics, tiny_args
from plugtrain.training.launch import configure, run_cli
from plugtrain.training.trainer import Trainer

TOKENIZER = SAMPLE / "tokenizer.json"
VALIDATION = SAMPLE / "validation.jsonl"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "validation"
    prepare([str(VALIDATION)], out, TOKENIZER, workers=1, shard_tokens=20_000)
    return out


def _losses(dump_folder: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(dump_folder) if "loss" in m]


def _train(dump_folder: Path, *args: str) -> Trainer:
    trainer = make_trainer(dump_folder, *args, steps=3)
    trainer.run()
    return trainer


def test_a_prepared_folder_trains_like_its_jsonl_which_is_cached_once(
    tmp_path: Path, folder: Path
) -> None:
    cached = cache_folder(VALIDATION, file_sha256(TOKENIZER), "text")
    _train(tmp_path / "jsonl")  # tiny_args trains on validation.jsonl: prepared into the cache
    written = (cached / MANIFEST).stat().st_mtime_ns
    _train(tmp_path / "folder", "--data.train_path", str(folder))
    _train(tmp_path / "again")
    assert (cached / MANIFEST).stat().st_mtime_ns == written  # reused, not prepared again
    assert len(_losses(tmp_path / "jsonl")) == 3
    assert (
        _losses(tmp_path / "folder") == _losses(tmp_path / "jsonl") == _losses(tmp_path / "again")
    )
    assert not any(p.name.endswith(".partial") for p in cached.parent.iterdir())


def test_resume_on_a_prepared_folder_is_exact(tmp_path: Path, folder: Path) -> None:
    result = interrupted_and_resumed(
        tmp_path, "--data.train_path", str(folder), steps=4, stop_after=2
    )
    assert result["stopped_at"] == result["step_at_resume"] == 2
    assert result["resumed"] == result["straight"]
    assert _losses(tmp_path / "resumed")[-2:] == _losses(tmp_path / "straight")[-2:]


def test_batches_on_a_prepared_folder_do_not_depend_on_the_world_size(folder: Path) -> None:
    data = PackedDataset(TokenStore(folder), 32)
    kw = {"global_batch_size": 8, "seed": 5}

    def loaders(world_size: int, grad_accum: int) -> list[StatefulBatchLoader]:
        return [
            StatefulBatchLoader(
                data, grad_accum_steps=grad_accum, rank=r, world_size=world_size, **kw
            )
            for r in range(world_size)
        ]

    one, two = loaders(1, 1), loaders(2, 2)
    for step in range(len(data) // 8 + 3):  # into the second epoch
        if step == 5:  # resume rank 0 and 1 from a checkpoint of the 1-rank run
            state = one[0].state_dict()
            two = loaders(2, 2)
            for loader in two:
                loader.load_state_dict(state)
        inputs = torch.cat([mb[0] for mb in one[0].next_batch()])
        split = torch.cat([mb[0] for loader in two for mb in loader.next_batch()])
        assert torch.equal(split, inputs), step
        assert {str(loader.state_dict()) for loader in two} == {str(one[0].state_dict())}


def test_a_folder_prepared_with_another_tokenizer_is_refused(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(TOKENIZER.read_text()), indent=1))  # same, new bytes
    argv = [*tiny_args(tmp_path / "run"), "--data.train_path", str(folder)]
    argv += ["--model.tokenizer_path", str(other)]
    assert run_cli(lambda: Trainer(*configure(argv))) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"plugtrain: error: data.train_path '{folder}' was prepared with another"
    )
    assert "set model.tokenizer_path to" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
