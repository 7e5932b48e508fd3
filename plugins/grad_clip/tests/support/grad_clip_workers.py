"""Test plugins, tiny runs and per-rank functions for the grad_clip tests.

The per-rank functions are module level so that ``distributed.run_distributed`` can pickle
them into its spawned processes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from runs import tiny_args
from workers import StepWatcher

from plugtrain.plugin import hookimpl, local_tensor
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer


def make_trainer(
    dump_folder: Path | str, *args: str, steps: int = 3, order: Sequence[tuple[str, object]] = ()
) -> Trainer:
    """A tiny run configured by ``args``, with extra plugins registered in ``order``.

    ``order`` lists ``(name, plugin)`` pairs registered in that order after the enabled
    plugins are loaded; a ``None`` plugin moves the enabled plugin of that name to its
    position, which lets a test register the same plugins in both orders.
    """
    config, host = configure([*tiny_args(Path(dump_folder), steps=steps), *args])
    plugins = [(name, host.get(name) if plugin is None else plugin) for name, plugin in order]
    for name, plugin in plugins:
        if name in host.names():
            host.unregister(plugin)
    for name, plugin in plugins:
        host.register(plugin, name)
    return Trainer(config, host)


def clip_args(max_norm: float, *extra: str) -> list[str]:
    """Arguments that enable grad_clip with ``max_norm`` and any other ``--grad_clip.*``."""
    return ["--plugins.enabled", "grad_clip", "--grad_clip.max_norm", str(max_norm), *extra]


class InfInjector:
    """Writes inf into one gradient element on one rank, in the make-true phase.

    With ``loss_scaler=True`` it also plays a loss scaler's part in non-finite handling: it
    declares itself with ``register_loss_scaler`` and vetoes the steps it poisoned.
    """

    def __init__(self, steps: Sequence[int], rank: int = 0, loss_scaler: bool = False) -> None:
        self.steps, self.rank, self.loss_scaler = set(steps), rank, loss_scaler
        self.my_rank = -1
        self.skip_reasons: dict[int, list[str]] = {}

    @hookimpl
    def setup(self, ctx):
        self.my_rank = ctx.rank
        if self.loss_scaler:
            ctx.register_loss_scaler(self)

    @hookimpl
    def unscale_gradients(self, ctx):
        if ctx.step in self.steps and self.my_rank == self.rank:
            grad = local_tensor(ctx.gradients()[0])
            grad[(0,) * grad.ndim] = math.inf

    @hookimpl
    def pre_step(self, ctx):
        if self.loss_scaler and ctx.step in self.steps:
            return "inf_injector: inf gradients"
        return None

    @hookimpl
    def post_step(self, ctx):
        self.skip_reasons[ctx.step] = list(ctx.skip_reasons)


class LogCapture(logging.Handler):
    """Keeps the messages of the ``plugtrain`` logger (rank 0 logs at INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logging.getLogger("plugtrain").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train_and_gather(dump_folder: str, args: list[str], steps: int) -> dict[str, torch.Tensor]:
    """Train a tiny run; return its full (unsharded) parameters, by name, on every rank."""
    trainer = make_trainer(dump_folder, *args, steps=steps)
    trainer.train()
    trainer.close()
    return {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters()}


def skip_nonfinite_on_every_rank(dump_folder: str) -> dict:
    """Poison step 2 on rank 1 only; record on each rank what the steps did.

    The max norm, whose per-rank parts are reduced only by ``full_tensor()`` (a Partial
    placement), so that a rank-local norm would let rank 0 miss rank 1's inf.
    """
    ref: list[Trainer] = []
    watcher = StepWatcher(ref)
    trainer = make_trainer(
        dump_folder,
        *clip_args(1.0, "--grad_clip.norm_type", "inf"),
        order=[("inf_injector", InfInjector(steps=[2], rank=1)), ("watcher", watcher)],
    )
    ref.append(trainer)
    logs = LogCapture()
    trainer.train()
    trainer.close()
    return {
        "rank": trainer.world.rank,
        "changed": watcher.changed,
        "lr_steps": watcher.lr_steps,
        "skipped_steps": int(trainer.vetoes.total),
        "skipped_by": {k: int(v) for k, v in trainer.vetoes.by_plugin.items()},
        "logs": logs.messages,
    }
