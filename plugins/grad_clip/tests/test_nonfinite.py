"""A non-finite total norm: skipped or raised without a loss scaler, left to one otherwise."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from plugtrain.plugin import SetupContext, StepContext, full_tensor, hookimpl
from plugtrain.testing import InjectInf, StepWatcher, make_trainer, run_distributed

CLIP_INF = ("--plugins.enabled", "grad_clip", "--grad_clip.max_norm", "1.0")


class ScalerStandIn(InjectInf):
    """Injects inf and plays a loss scaler's part in non-finite handling: it declares itself
    with ``register_loss_scaler`` and vetoes the steps it poisoned."""

    def __init__(self, steps: Sequence[int]) -> None:
        super().__init__(steps)
        self.skip_reasons: dict[int, list[str]] = {}

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        ctx.register_loss_scaler(self)

    @hookimpl
    def pre_step(self, ctx: StepContext) -> str | None:
        return "inf_injector: inf gradients" if ctx.step in self.steps else None

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        self.skip_reasons[ctx.step] = list(ctx.skip_reasons)


class LogCapture(logging.Handler):
    """Keeps the messages of the ``plugtrain`` logger (rank 0 logs at INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logging.getLogger("plugtrain").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def skip_nonfinite_on_every_rank(dump_folder: str) -> dict:
    """Run on each rank: inf in rank 1's shard at step 2 only; what the steps did.

    The max norm, whose per-rank parts are reduced only by ``full_tensor()`` (a Partial
    placement), so that a rank-local norm would let rank 0 miss rank 1's inf.
    """
    watcher = StepWatcher()
    trainer = make_trainer(
        dump_folder, *CLIP_INF, "--grad_clip.norm_type", "inf",
        plugins=[("inf_injector", InjectInf(steps=[2], ranks=[1])), ("watcher", watcher)],
    )  # fmt: skip
    watcher.trainer = trainer
    logs = LogCapture()
    trainer.run()
    return {
        "rank": trainer.parallel_dims.rank,
        "changed": watcher.changed,
        "lr_steps": watcher.lr_steps,
        "skipped_steps": int(trainer.vetoes.total),
        "skipped_by": {k: int(v) for k, v in trainer.vetoes.by_plugin.items()},
        "logs": logs.messages,
    }


@pytest.mark.slow
def test_skip_leaves_parameters_and_schedule_unchanged_on_every_rank(tmp_path):
    # inf goes into rank 1's shard only: the global norm must make rank 0 skip too.
    results = run_distributed(skip_nonfinite_on_every_rank, 2, str(tmp_path))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["changed"] == {1: True, 2: False, 3: True}, r
        assert r["lr_steps"] == {1: 1, 2: 1, 3: 2}, r
        assert r["skipped_steps"] == 1 and r["skipped_by"] == {"grad_clip": 1}, r
    # A device veto: no per-step log line (it would need a host read); the logging step says it.
    assert not any("skipped:" in line for line in results[0]["logs"])


def test_raise_names_the_step_and_the_fix(tmp_path, clip_args):
    trainer = make_trainer(
        tmp_path, *clip_args(1.0, "--grad_clip.on_nonfinite", "raise"),
        plugins=[("inf_injector", InjectInf(steps=[2]))],
    )  # fmt: skip
    before = [full_tensor(p.detach()).clone() for p in trainer.model.parameters()]
    with pytest.raises(
        FloatingPointError,
        match=r"^grad_clip: the total gradient norm at step 2 is not finite: .* set "
        r"grad_clip.on_nonfinite = 'skip' to skip such steps\)$",
    ):
        trainer.run()  # log_freq 1: raised at step 2's logging, the first read of the device
    assert trainer.step == 2 and int(trainer.vetoes.total) == 1  # step 2 was skipped, too
    assert not all(
        torch.equal(a, full_tensor(p.detach()))
        for a, p in zip(before, trainer.model.parameters(), strict=True)
    )  # step 1 trained


@pytest.mark.parametrize("scaler_setup_first", [True, False])
def test_left_to_the_loss_scaler_when_one_is_enabled(tmp_path, clip_args, scaler_setup_first):
    # pluggy calls setup last-registered first: registering grad_clip last makes its setup run
    # before the scaler declares itself, which a check made in setup would miss.
    injector = ScalerStandIn(steps=[2])
    order = [("grad_clip", None), ("inf_injector", injector)]
    trainer = make_trainer(
        tmp_path, *clip_args(1.0, "--grad_clip.on_nonfinite", "raise"),
        plugins=order if scaler_setup_first else order[::-1],
    )  # fmt: skip
    trainer.run()  # no FloatingPointError: the scaler owns non-finite gradients
    assert injector.skip_reasons == {1: [], 2: ["inf_injector: inf gradients"], 3: []}
    assert int(trainer.vetoes.total) == 1
