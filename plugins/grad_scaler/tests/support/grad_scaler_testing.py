"""Helpers for the grad_scaler plugin's tests: runs of the real trainer and an inf injector."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
from runs import tiny_args

from plugtrain.launch import configure
from plugtrain.plugin import StepContext, gradients, hookimpl, local_tensor
from plugtrain.trainer import Trainer

FP16 = ("--training.mixed_precision_param", "float16")


def make_trainer(
    dump_folder: str | Path,
    *args: str,
    steps: int = 3,
    extra: dict[str, object] | None = None,
    first: dict[str, object] | None = None,
) -> Trainer:
    """A trainer of the tiny model; ``extra`` plugins are registered after the enabled ones,
    ``first`` plugins before them (pluggy calls later registrations first)."""
    config, host = configure([*tiny_args(Path(dump_folder), steps=steps), *args])
    enabled = [(name, host.get(name)) for name in host.names()]
    for _, plugin in enabled:
        host.unregister(plugin)
    for name, plugin in [*(first or {}).items(), *enabled, *(extra or {}).items()]:
        host.register(plugin, name)
    return Trainer(config, host)


def poison(model: torch.nn.Module) -> None:
    """Put inf into this rank's shard of the model's first gradient."""
    local_tensor(gradients(model)[0]).view(-1)[0] = float("inf")


class InjectInf:
    """Poisons a gradient on chosen steps (and ranks) before any plugin sees the gradients.

    NOTE: a ``wrapper=True`` implementation's code before ``yield`` runs before every plain
    one, the "run first" (tryfirst) unscaling included, whatever the registration order.
    """

    def __init__(self, steps: Collection[int], ranks: Collection[int] = (0,)) -> None:
        self.steps, self.ranks = set(steps), set(ranks)

    @hookimpl(wrapper=True)
    def post_backward(self, ctx: StepContext):
        if ctx.step in self.steps and dist.get_rank() in self.ranks:
            poison(ctx.model)
        return (yield)


def read_metrics(dump_folder: str | Path) -> list[dict]:
    """The JSONL records a run wrote (rank 0), in order."""
    lines = (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
