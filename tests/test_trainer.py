"""The trainer's own promises: determinism, accumulation, schedule, validation."""

from __future__ import annotations

import math

import pytest
import torch

from plugtrain.config import LRSchedulerConfig
from plugtrain.testing import read_metrics, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.optim import lr_factor
from plugtrain.training.trainer import Trainer


def train(dump_folder, *args: str, steps: int = 4) -> list[dict]:
    trainer = Trainer(*configure([*tiny_args(dump_folder, steps=steps), *args]))
    trainer.run()
    return read_metrics(dump_folder)


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def test_same_config_gives_identical_losses(tmp_path):
    assert losses(train(tmp_path / "a")) == losses(train(tmp_path / "b"))
    assert losses(train(tmp_path / "c", "--training.seed", "1")) != losses(train(tmp_path / "d"))


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    full = losses(train(tmp_path / "full", "--training.batch_size", "8"))
    accum = losses(
        train(tmp_path / "acc", "--training.batch_size", "8", "--training.grad_accum_steps", "4")
    )
    assert accum == pytest.approx(full, rel=1e-5)


def test_validation_loss_is_logged_on_schedule(tmp_path):
    records = train(tmp_path, "--validation.interval", "2", "--validation.steps", "2", steps=4)
    val = [r for r in records if "validation_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    assert all(math.isfinite(r["validation_loss"]) and r["validation_loss"] > 0 for r in val)


@pytest.mark.parametrize(
    ("decay", "expected"),
    [
        ("cosine", [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]),
        ("linear", [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]),
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_lr_schedule_warms_up_then_decays(decay, expected):
    cfg = LRSchedulerConfig(warmup_steps=2, decay_type=decay, min_lr_ratio=0.1)
    got = [lr_factor(torch.tensor(step), cfg, total_steps=4).item() for step in range(6)]
    assert got == pytest.approx(expected)


def test_cosine_is_halfway_at_half_the_decay():
    cfg = LRSchedulerConfig(warmup_steps=0, decay_type="cosine", min_lr_ratio=0.0)
    half, quarter = (lr_factor(torch.tensor(s), cfg, total_steps=100).item() for s in (50, 25))
    assert half == pytest.approx(0.5)
    assert quarter == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
