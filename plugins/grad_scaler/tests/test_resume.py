"""The scaler's state in checkpoints: a resumed float16 run continues exactly."""

from __future__ import annotations

import grad_scaler_testing as gst
import pytest
from distributed import run_distributed

METRICS = ("loss", "grad_scaler/loss_scale", "grad_scaler/skipped_steps", "skipped_steps")


def by_step(records: list[dict]) -> list[tuple]:
    return [tuple(r.get(k) for k in ("step", *METRICS)) for r in records if "loss" in r]


def assert_resumed_exactly(r: dict) -> None:
    """Parameters, and (on rank 0, which logs) losses, scale and skipped steps of the resumed
    run are the uninterrupted run's."""
    assert r["step_at_resume"] == gst.checkpoint_workers.K
    for name, tensor in r["resumed_params"].items():
        assert tensor.equal(r["straight_params"][name]), name
    if r["rank"] == 0:
        resumed = by_step(r["resumed_records"])
        assert resumed == by_step(r["straight_records"])
        scales = [scale for _, _, scale, _, _ in resumed]
        assert scales[gst.checkpoint_workers.K - 1] != 1e6 and len(set(scales)) > 1  # evolved


def test_float16_with_the_scaler_resumes_exactly(tmp_path):
    assert_resumed_exactly(gst.interrupted_and_resumed(str(tmp_path), sigterm_rank=0))


@pytest.mark.slow
def test_two_processes_resume_exactly_after_sigterm_on_one_rank(tmp_path):
    for r in run_distributed(gst.interrupted_and_resumed, 2, str(tmp_path), 1):
        assert_resumed_exactly(r)
