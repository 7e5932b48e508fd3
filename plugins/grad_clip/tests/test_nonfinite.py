"""A non-finite total norm: skipped or raised without a loss scaler, left to one otherwise."""

from __future__ import annotations

import grad_clip_workers as workers
import pytest
import torch
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
        assert r["skipped_steps"] == 1 and r["skipped_by"] == {"grad_clip": 1}, r
    # A device veto: no per-step log line (it would need a host read); the logging step says it.
    assert not any("skipped:" in line for line in results[0]["logs"])


def test_raise_names_the_step_and_the_fix(tmp_path):
    trainer = make_trainer(
        tmp_path, *clip_args(1.0, "--grad_clip.on_nonfinite", "raise"),
        order=[("inf_injector", InfInjector(steps=[2]))],
    )  # fmt: skip
    before = [p.detach().full_tensor().clone() for p in trainer.model.parameters()]
    with pytest.raises(
        FloatingPointError,
        match=r"^grad_clip: the total gradient norm at step 2 is not finite: .* set "
        r"grad_clip.on_nonfinite = 'skip' to skip such steps\)$",
    ):
        trainer.train()  # log_freq 1: raised at step 2's logging, the first read of the device
    assert trainer.step == 2 and int(trainer.vetoes.total) == 1  # step 2 was skipped, too
    assert not all(
        torch.equal(a, p.detach().full_tensor())
        for a, p in zip(before, trainer.model.parameters(), strict=True)
    )  # step 1 trained


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
    assert int(trainer.vetoes.total) == 1
