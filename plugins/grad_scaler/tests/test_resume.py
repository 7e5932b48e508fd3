"""The scaler's state in checkpoints: a resumed float16 run continues exactly."""

from __future__ import annotations

import pytest
import torch

from plugtrain.testing import interrupted_and_resumed, run_distributed

STOP = 4
"""Steps before the interruption; the runs train twice as many."""
RESUME_ARGS = ("--training.mixed_precision_param", "float16", "--plugins.enabled", "grad_scaler",
               "--grad_scaler.init_scale", "1e6", "--grad_scaler.growth_interval", "2")  # fmt: skip
"""The scale too high at first: steps 1, 2 and 5 overflow and are skipped, the scale backs off
and grows again, so its state at the interruption is not its initial one."""
METRICS = ("loss", "grad_scaler/loss_scale", "grad_scaler/skipped_steps", "skipped_steps")


def by_step(records: list[dict]) -> list[tuple]:
    return [tuple(r.get(k) for k in ("step", *METRICS)) for r in records if "loss" in r]


def assert_resumed_exactly(r: dict) -> None:
    """Parameters, and (on rank 0, which logs) losses, scale and skipped steps of the resumed
    run are the uninterrupted run's."""
    assert r["stopped_at"] == r["step_at_resume"] == STOP
    assert r["resumed"] == r["straight"]  # this rank's parameters, bitwise
    if r["rank"] == 0:
        resumed = by_step(r["resumed_metrics"])
        assert resumed == by_step(r["straight_metrics"])
        scales = [scale for _, _, scale, _, _ in resumed]
        assert scales[STOP - 1] != 1e6 and len(set(scales)) > 1  # evolved


def resumed_with_the_scaler(root: str, sigterm_rank: int) -> dict:
    """Run on each rank (or in-process): interrupted after STOP steps and resumed."""
    torch.set_num_threads(1)
    return interrupted_and_resumed(
        root, *RESUME_ARGS, steps=2 * STOP, stop_after=STOP, sigterm_rank=sigterm_rank
    )


def test_float16_with_the_scaler_resumes_exactly(tmp_path):
    assert_resumed_exactly(resumed_with_the_scaler(str(tmp_path), 0))


@pytest.mark.slow
def test_two_processes_resume_exactly_after_sigterm_on_one_rank(tmp_path):
    for r in run_distributed(resumed_with_the_scaler, 2, str(tmp_path), 1):
        assert_resumed_exactly(r)
