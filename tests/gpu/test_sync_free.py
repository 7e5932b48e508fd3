"""No host sync in a training step on CUDA, but for the logging steps' reads.

CUDA's sync debug mode set to "error" makes any synchronizing call raise (``.item()``, a
blocking copy, ``torch.cuda.synchronize``...). It is armed from the second step on (the first
initialises lazily: FSDP2, the optimizer's state) and lifted only while a logging step reads
its numbers (``Trainer._log_step``): the steps in between run the whole loop under it, the
prefetch of the next batch included. On the CPU (the hidden switch) the syncs are counted.
"""

from __future__ import annotations

import math

import pytest

from plugtrain.plugin import StepContext, hookimpl
from plugtrain.testing import Trainer, make_trainer, read_metrics

STEPS = 5
LOGGED = ("--metrics.log_freq", "1000")  # steps 1 and STEPS log, the others do not
CASES = {
    "grad_clip+grad_scaler fp16": (
        "--plugins.enabled", "grad_clip,grad_scaler",
        "--training.mixed_precision_param", "float16",
    ),
    "grad_clip bf16": (
        "--plugins.enabled", "grad_clip", "--training.mixed_precision_param", "bfloat16",
    ),
    # flex attention, and its BlockMask built each forward
    "document masking bf16": (
        "--model.attention", "document", "--training.mixed_precision_param", "bfloat16",
    ),
}  # fmt: skip


def guarded_run(trainer: Trainer, guard) -> list[int]:
    """Train with syncs forbidden from the second step on, except in the logging steps' reads;
    the steps that ran under the guard."""
    step, log_step = trainer.train_step, trainer._log_step
    guarded: list[int] = []

    def train_step(batch):
        if trainer.step >= 1:
            guard.arm()
            guarded.append(trainer.step + 1)
        return step(batch)

    def logging(*args):
        with guard.lifted():
            return log_step(*args)

    trainer.train_step, trainer._log_step = train_step, logging
    try:
        trainer.train()
    except BaseException:
        guard.disarm()
        trainer.abort()
        raise
    guard.disarm()
    trainer.close()
    guard.check()
    return guarded


@pytest.mark.parametrize("case", CASES)
def test_no_sync_between_logging_steps(tmp_path, device_args, sync_guard, case):
    trainer = make_trainer(tmp_path, *device_args, *LOGGED, *CASES[case], steps=STEPS)
    assert guarded_run(trainer, sync_guard) == [2, 3, 4, 5]
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [1, STEPS]
    assert all(math.isfinite(r["loss"]) for r in records)
    if "grad_clip/grad_norm" in records[-1]:
        assert records[-1]["grad_clip/grad_norm"] > 0


class ReadsTheLoss:
    """A plugin that reads the loss on the host in step 3: the sync the guard must catch."""

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        if ctx.step == 3:
            float(ctx.loss.detach())


def test_the_guard_catches_a_sync_in_a_step(tmp_path, device_args, sync_guard):
    """The control: one host read in a non-logging step raises."""
    bf16 = CASES["grad_clip bf16"]
    plugins = [("reads_the_loss", ReadsTheLoss())]
    trainer = make_trainer(tmp_path, *device_args, *LOGGED, *bf16, steps=STEPS, plugins=plugins)
    with pytest.raises(RuntimeError, match="synchroniz"):
        guarded_run(trainer, sync_guard)
