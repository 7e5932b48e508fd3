"""Functions run on each rank by ``distributed.run_distributed`` (module level: picklable)."""

from __future__ import annotations

import torch
from runs import tiny_args

from plugtrain.plugin import hookimpl
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer


class StepWatcher:
    """Records, per step, whether this rank's parameter shards changed and the LR step count."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.before: list[torch.Tensor] = []
        self.changed: dict[int, bool] = {}
        self.lr_steps: dict[int, int] = {}

    @hookimpl
    def pre_step(self, ctx):
        self.before = [p.detach().to_local().clone() for p in ctx.parameters()]

    @hookimpl
    def post_step(self, ctx):
        after = [p.detach().to_local() for p in ctx.parameters()]
        self.changed[ctx.step] = not all(
            torch.equal(a, b) for a, b in zip(self.before, after, strict=True)
        )
        self.lr_steps[ctx.step] = int(self.trainer_ref[0].lr_scheduler.applied_steps)


def veto_on_every_rank(dump_folder: str) -> dict:
    config, host = configure(
        [*tiny_args(dump_folder, steps=3), "--plugins.enabled", "hook_recorder",
         "--hook_recorder.veto_steps", "[2]"]
    )  # fmt: skip
    ref: list = []
    watcher = StepWatcher(ref)
    host.register(watcher, "watcher")
    trainer = Trainer(config, host)
    ref.append(trainer)
    trainer.train()
    trainer.close()
    return {"changed": watcher.changed, "lr_steps": watcher.lr_steps, "rank": trainer.world.rank}
