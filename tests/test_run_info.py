"""What a run leaves and says: its last step saved without checkpoint.enable
(``checkpoint.save_final``), the modes named at start-up and recorded in run.json, and the
summary at the end with the commands to try next."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from plugtrain.checkpoint import complete_checkpoints, read_checkpoint
from plugtrain.cli import main
from plugtrain.commands.train import train
from plugtrain.testing import make_trainer, read_metrics, tiny_args, tiny_run

FINAL = ("--checkpoint.save_final", "true")
"""What a run does by default, which the test kit's runs turn off."""


@pytest.fixture(autouse=True)
def one_thread():
    """NOTE: in-process trainers on a busy 2-core machine are far faster with one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def final_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step run with checkpoint.enable off, as a default run: it saves step 3 alone."""
    folder = tmp_path_factory.mktemp("final") / "run"
    tiny_run(folder, *FINAL)
    return folder


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of ``run``'s dump folder, for a test that writes to it."""
    return Path(shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns(".*lock")))


# -- checkpoint.save_final ---------------------------------------------------------------------


def test_the_last_step_is_saved_as_a_periodic_checkpoint_is(final_run, tmp_path, capsys):
    checkpoints = complete_checkpoints(final_run / "checkpoints")
    assert list(checkpoints) == [3]
    # Bit for bit what checkpoint.enable saves at the same step: model, optimizer, data, RNGs.
    tiny_run(tmp_path, "--checkpoint.enable", "true")
    saved, periodic = (
        read_checkpoint(checkpoints[3]),
        read_checkpoint(tmp_path / "checkpoints" / "step-3"),
    )
    assert saved.keys() == periodic.keys() and any(k.startswith("optimizer.") for k in saved)
    assert [k for k, t in saved.items() if not torch.equal(t, periodic[k])] == []
    capsys.readouterr()
    assert main(["generate", str(final_run), "--prompt", "ROMEO:", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_checkpoint_enable_resumes_from_it(final_run, tmp_path):
    trainer = make_trainer(copy_of(final_run, tmp_path), "--checkpoint.enable", "true", steps=4)
    try:
        assert trainer.step == 3
    finally:
        trainer.abort()


def test_a_second_run_into_its_folder_is_refused_in_one_line(final_run, tmp_path, capsys):
    folder = copy_of(final_run, tmp_path)
    before = (folder / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert train(tiny_args(folder, *FINAL)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"plugtrain: error: checkpoint.enable is off (start afresh, save the last step), but "
        f"{folder / 'checkpoints'} holds checkpoints of an earlier run (steps 3): add "
        "--checkpoint.enable true to resume from step 3, train in another job.dump_folder, or "
        "add --checkpoint.discard_later true to delete them"
    ]
    assert (folder / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in folder.glob("metrics*")) == ["metrics.jsonl"]
    # With save_final off it saves nothing, so nothing is refused (the kit's runs).
    assert train(tiny_args(folder, steps=2)) == 0
    assert list(complete_checkpoints(folder / "checkpoints")) == [3]
    # Asked to, it deletes them and saves its own.
    assert train(tiny_args(folder, *FINAL, "--checkpoint.discard_later", "true", steps=2)) == 0
    assert "deleted step-3 (checkpoint.discard_later)" in capsys.readouterr().err
    assert list(complete_checkpoints(folder / "checkpoints")) == [2]


def test_it_saves_once_whatever_else_saves(tmp_path):
    # Due by the interval too: one save (a second would be refused as a complete one exists).
    every = (
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "1",
    )
    tiny_run(tmp_path / "interval", *FINAL, *every, steps=3)
    assert list(complete_checkpoints(tmp_path / "interval" / "checkpoints")) == [3]
    # Written in the background, committed before the run returns.
    tiny_run(tmp_path / "async", *FINAL, "--checkpoint.async_mode", "async", steps=2)
    assert list(complete_checkpoints(tmp_path / "async" / "checkpoints")) == [2]
    assert [r["step"] for r in read_metrics(tmp_path / "async")] == [1, 2]
