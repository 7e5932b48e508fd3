"""The trainer's own promises: determinism, accumulation, schedule, validation."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plugtrain.checkpoint.rng import rng_state, seed_generators
from plugtrain.config import LRSchedulerConfig
from plugtrain.data import iter_eval_batches
from plugtrain.observability import CostCounter
from plugtrain.plugin import hookimpl
from plugtrain.testing import make_trainer, read_metrics, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.optim import LRSchedule, lr_factor
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


def test_validation_bpb_is_the_summed_loss_in_bits_over_the_targets_bytes(tmp_path):
    trainer = make_trainer(tmp_path, "--validation.interval", "1", "--validation.steps", "2")
    got = trainer.validate()
    nats, num_bytes, num_tokens = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets, *_ in iter_eval_batches(
            trainer.val_data, batch_size=4, rank=0, world_size=1, max_batches=2
        ):
            logits = trainer.model(inputs).double().flatten(0, 1)
            nats += F.cross_entropy(logits, targets.flatten(), reduction="sum").item()
            num_tokens += targets.numel()
            # The text each row's targets stand for (ASCII here, so rows split no character)
            rows = targets.tolist()
            texts = (trainer.tokenizer.decode(r, skip_special_tokens=True) for r in rows)
            num_bytes += sum(len(text.encode()) for text in texts)
    trainer.close()
    assert num_tokens < num_bytes < 8 * num_tokens
    assert got["validation_bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-6)
    assert got["validation_loss"] == pytest.approx(nats / num_tokens, rel=1e-6)


class Draws:
    """Draws from Python's, NumPy's and torch's global generators in setup and each step."""

    def __init__(self) -> None:
        self.draws: list[tuple[float, float, float]] = []

    def _draw(self) -> None:
        self.draws.append((random.random(), float(np.random.rand()), torch.rand(()).item()))

    @hookimpl
    def setup(self) -> None:
        self._draw()

    @hookimpl
    def post_step(self) -> None:
        self._draw()


def generators() -> list:
    """This process's generator states, comparable with ``==``."""
    state = rng_state(torch.device("cpu"))
    return [
        state["torch"].tolist(),
        state["python"]["words"].tolist(),
        state["numpy"]["keys"].tolist(),
        state["numpy"]["pos"],
    ]


def run_drawing(folder, *args: str) -> tuple[list, list]:
    """A fresh 3-step run with :class:`Draws`; its draws and the generators' final states."""
    draws = Draws()
    trainer = make_trainer(folder, *args, plugins=[("draws", draws)])
    trainer.train()
    trainer.close()
    return draws.draws, generators()


def test_the_seed_seeds_the_global_generators_of_fresh_runs(tmp_path):
    first = run_drawing(tmp_path / "a")
    # Whatever the process drew before, a fresh run with the same seed draws the same.
    random.random(), np.random.rand(), torch.rand(5)
    assert run_drawing(tmp_path / "b") == first
    other = run_drawing(tmp_path / "c", "--training.seed", "1")
    assert all(a != b for a, b in zip(other[0], first[0], strict=True))


def test_each_rank_and_seed_gets_its_own_stream():
    states = {}
    for seed, rank in [(0, 0), (0, 1), (1, 0), (0, 0)]:
        seed_generators(seed, rank)
        draws = random.random(), float(np.random.rand()), torch.rand(()).item()
        states.setdefault((seed, rank), []).append((draws, generators()))
    assert states[0, 0][0] == states[0, 0][1]  # deterministic
    for a, b in [((0, 0), (0, 1)), ((0, 0), (1, 0)), ((0, 1), (1, 0))]:
        (draws_a, gen_a), (draws_b, gen_b) = states[a][0], states[b][0]
        assert all(x != y for x, y in zip(draws_a, draws_b, strict=True)), (a, b)
        assert all(x != y for x, y in zip(gen_a[:3], gen_b[:3], strict=True)), (a, b)


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


WSD_SHAPES = {
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def wsd_factor(step: int, shape: str, warmup: int, decay: int, total: int, floor: float) -> float:
    """The warmup-stable-decay factor written out, in Python's float64."""
    if step < warmup:
        return (step + 1.0) / warmup
    progress = min(max((step - (total - decay)) / decay, 0.0), 1.0)
    return floor + (1.0 - floor) * WSD_SHAPES[shape](progress)


@pytest.mark.parametrize("shape", WSD_SHAPES)
def test_wsd_warms_up_stays_at_the_peak_then_decays_over_its_last_steps(shape):
    warmup, decay, total, floor = 3, 8, 16, 0.1
    cfg = LRSchedulerConfig(
        warmup_steps=warmup, decay_type="wsd", decay_steps=decay, decay_shape=shape,
        min_lr_ratio=floor,
    )  # fmt: skip
    got = [lr_factor(torch.tensor(s), cfg, total_steps=total).item() for s in range(total + 2)]
    want = [wsd_factor(s, shape, warmup, decay, total, floor) for s in range(total + 2)]
    # Exact but for torch's float64 sqrt and cos on CPU, which may be 1 ulp off math's.
    assert got == (want if shape == "linear" else pytest.approx(want, rel=0, abs=1e-15))
    first, last = total - decay, total - 1  # the steps after `first` and `last` applied ones
    assert got[warmup : first + 1] == [1.0] * (first + 1 - warmup)  # stable; decay's first step
    assert got[first + 1] < 1.0
    assert got[last] == pytest.approx(floor + (1 - floor) * WSD_SHAPES[shape](7 / 8), abs=1e-15)
    assert got[last] > floor
    assert got[total:] == [floor, floor]


def test_a_vetoed_step_leaves_the_wsd_schedule_where_it_was():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=torch.tensor(0.5), fused=True)
    cfg = LRSchedulerConfig(warmup_steps=0, decay_type="wsd", decay_steps=4, min_lr_ratio=0.0)
    schedule = LRSchedule(optimizer, cfg, total_steps=4)
    lrs = []
    with CostCounter() as costs:
        for applied in [True, False, True, False, False, True]:
            schedule.step(torch.tensor(applied))
            lrs.append(schedule.last_lr().clone())
    assert costs.sync_sites.total() == 0, costs.sync_sites  # tensors only: no host read
    factors = [wsd_factor(s, "1-sqrt", 0, 4, 4, 0.0) for s in (1, 1, 2, 2, 2, 3)]
    assert [lr.item() for lr in lrs] == [torch.tensor(0.5 * f).item() for f in factors]
    assert int(schedule.applied_steps) == 3


def test_cosine_is_halfway_at_half_the_decay():
    cfg = LRSchedulerConfig(warmup_steps=0, decay_type="cosine", min_lr_ratio=0.0)
    half, quarter = (lr_factor(torch.tensor(s), cfg, total_steps=100).item() for s in (50, 25))
    assert half == pytest.approx(0.5)
    assert quarter == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
