"""Plugins' run requests in a real run: skipping batch ranges, and stopping."""

from __future__ import annotations

from plugtrain.data.skips import read_skip_file
from plugtrain.plugin import SetupContext, SkipRange, StepContext, hookimpl
from plugtrain.testing import make_trainer


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
