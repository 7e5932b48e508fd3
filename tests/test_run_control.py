"""Plugins' run requests in a real run: skipping batch ranges, and stopping."""

from __future__ import annotations

from plugtrain.data.skips import read_skip_file
from plugtrain.plugin import SetupContext, SkipRange, StepContext, hookimpl
from plugtrain.testing import make_trainer, read_metrics


class Requests:
    """Skips batches 2-3 from set-up on, and stops the run after step 3."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        ctx.control.skip_batches(2, 3, "requests", "bad data")

    @hookimpl
    def pre_step(self, ctx: StepContext) -> None:
        self.batches.append(ctx.batch)

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> None:
        if ctx.step == 3:
            ctx.control.stop("requests", "enough")


def test_skipped_batches_and_a_stop(tmp_path, capfd):
    requests = Requests()
    trainer = make_trainer(
        tmp_path, "--checkpoint.enable", "true", steps=5, plugins=[("requests", requests)]
    )
    trainer.run()
    assert requests.batches == [1, 4, 5]
    assert trainer.step == 3
    assert (tmp_path / "checkpoints" / "step-3").is_dir()
    stopped = "stopped after step 3 on the request of plugin 'requests': enough"
    assert stopped in capfd.readouterr().err
    assert read_skip_file(tmp_path) == ([SkipRange(2, 3, "requests", "bad data")], None)


class RewindOnce:
    """Asks, at step 5, for a rewind to the checkpoint of step 2 or earlier, skipping through
    batch 5 (once: the replayed steps never ask again)."""

    def __init__(self) -> None:
        self.asked = False

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> None:
        if ctx.step == 5 and not self.asked:
            self.asked = True
            ctx.control.rewind(ctx.step, 2, 5, "rewinder", "test")


def test_a_rewind_leaves_each_step_once_in_the_metrics(tmp_path):
    ckpt = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")
    trainer = make_trainer(tmp_path, *ckpt, steps=6, plugins=[("rewinder", RewindOnce())])
    trainer.run()
    records = read_metrics(tmp_path)
    # The steps after the checkpoint rewound to are those of the run that goes on: steps 3-5
    # as first trained were undone, and a resume cuts the file at its first later step.
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
