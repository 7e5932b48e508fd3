"""A non-finite total norm: skipped or raised without a loss scaler, left to one otherwise."""

from __future__ import annotations

import grad_clip_workers as workers
import pytest
from distributed import run_distributed
from grad_clip_workers import InfInjector, clip_args, make_trainer


@pytest.mark.slow
def test_skip_leaves_parameters_and_schedule_unchanged_on_every_rank(tmp_path):
    # inf goes into rank 1's shard only: the global norm must make rank 0 skip too.
    results = run_distributed(workers.skip_nonfinite_on_every_rank, 2, str(tmp_path))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["changed"] == {1: True, 2: False, 3: True}, r
        assert r["lr_steps"] == {1: 1, 2: 1, 3: 2}, r
        assert r["skipped_steps"] == 1, r
    reason = (
        "step 2 skipped: grad_clip: total gradient norm is inf (grad_clip.on_nonfinite = 'skip')"
    )
    assert reason in results[0]["logs"]


def test_raise_names_the_step_and_the_fix(tmp_path):
    trainer = make_trainer(
        tmp_path, *clip_args(1.0, "--grad_clip.on_nonfinite", "raise"),
        order=[("inf_injector", InfInjector(steps=[2]))],
    )  # fmt: skip
    with pytest.raises(
        FloatingPointError,
        match=r"^grad_clip: the total gradient norm at step 2 is inf: .* set "
        r"grad_clip.on_nonfinite = 'skip' to skip such steps\)$",
    ):
        trainer.train()
    assert trainer.step == 1


@pytest.mark.parametrize("scaler_setup_first", [True, False])
def test_left_to_the_loss_scaler_when_one_is_enabled(tmp_path, scaler_setup_first):
    # pluggy calls setup last-registered first: registering grad_clip last makes its setup run
    # before the scaler declares itself, which a check made in setup would miss.
    injector = InfInjector(steps=[2], loss_scaler=True)
    order = [("grad_clip", None), ("inf_injector", injector)]
    trainer = make_trainer(
        tmp_path, *clip_args(1.0, "--grad_clip.on_nonfinite", "raise"),
        order=order if scaler_setup_first else order[::-1],
    )  # fmt: skip
    trainer.train()  # no FloatingPointError: the scaler owns non-finite gradients
    assert injector.skip_reasons == {1: [], 2: ["inf_injector: inf gradients"], 3: []}
    assert trainer.skipped_steps == 1
