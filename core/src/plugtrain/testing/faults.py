"""Faults for tests: inf in the loss or the gradients, poisoned batches, a SIGTERM mid-run.

:class:`InjectInf` puts inf into the loss or one rank's gradients at given steps (:func:`poison`
does it by hand); :class:`PoisonBatches` makes given global batches spike, wherever a rewind
puts them; :class:`SigtermAt` stops a run with SIGTERM on one rank, and
:func:`interrupted_and_resumed` checks that a stopped run resumes exactly.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from plugtrain.plugin import SetupContext, StepContext, hookimpl, local_tensor
from plugtrain.testing.runs import Plugins, make_trainer, parameter_checksums, read_metrics


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class InjectInf:
    """Puts inf into the loss or into one gradient element, on chosen steps and ranks.

    ``where="gradients"``: a ``wrapper=True`` implementation of ``unscale_gradients`` that
    writes ``value`` into this rank's shard of the first gradient before every plain
    implementation runs (a loss scaler's unscaling included), whatever the registration order.
    ``where="loss"``: a ``wrapper=True`` ``pre_backward`` that multiplies the loss by ``value``
    before a loss scaler sees it (every microbatch of the step), so every gradient is non-finite.
    """

    def __init__(
        self,
        steps: Collection[int],
        ranks: Collection[int] = (0,),
        where: str = "gradients",
        value: float = math.inf,
    ) -> None:
        if where not in ("gradients", "loss"):
            raise ValueError(f"where must be 'gradients' or 'loss', got {where!r}")
        self.steps, self.ranks, self.where, self.value = set(steps), set(ranks), where, value

    def _due(self, ctx: StepContext) -> bool:
        return ctx.step in self.steps and _rank() in self.ranks

    @hookimpl(wrapper=True)
    def pre_backward(self, ctx: StepContext) -> Iterator[None]:
        if self.where == "loss" and self._due(ctx) and ctx.loss is not None:
            ctx.loss = ctx.loss * self.value
        return (yield)

    @hookimpl(wrapper=True)
    def unscale_gradients(self, ctx: StepContext) -> Iterator[None]:
        if self.where == "gradients" and self._due(ctx):
            poison(ctx.model, self.value)
        return (yield)


class PoisonBatches:
    """Poisoned data: multiplies the loss of the chosen global batches (``StepContext.batch``)
    by ``factor``, after a ``wrapper=True`` implementation (spike_guard) took the step's loss,
    so that their gradients spike. Tied to the batches, not the steps: a run that rewinds and
    skips them never sees them again."""

    def __init__(self, batches: Collection[int], factor: float = 1e4) -> None:
        self.batches, self.factor = set(batches), factor

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        if ctx.batch in self.batches and ctx.loss is not None:
            ctx.loss = ctx.loss * self.factor


def poison(model: nn.Module, value: float = math.inf) -> None:
    """Write ``value`` (inf, nan) into this rank's shard of the model's first gradient."""
    first = next(p.grad for p in model.parameters() if p.grad is not None)
    local_tensor(first).view(-1)[0] = value


class SigtermAt:
    """Sends its own process SIGTERM, on rank ``rank`` only, so that the run stops cleanly
    after step ``step`` (every rank agreeing, a checkpoint saved if checkpointing is on).

    On several processes the ranks' stop vote reads a step late (it never makes a step wait),
    so the signal goes out mid-step ``step - 1`` there.
    """

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank, self.my_rank = step, rank, -1

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.my_rank = ctx.parallel_dims.rank
        self.step -= ctx.parallel_dims.world_size > 1

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        if ctx.step == self.step and self.my_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def interrupted_and_resumed(
    dump_folder: str | Path,
    *args: str,
    steps: int = 8,
    stop_after: int = 4,
    sigterm_rank: int = 0,
    plugins: Callable[[], Plugins] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps straight; then the same run with checkpointing, stopped after
    ``stop_after`` steps by a SIGTERM only rank ``sigterm_rank`` gets, and resumed to the end.

    ``plugins`` makes fresh plugin objects for each of the three runs (a module-level function
    on several processes). Returns, on each rank: ``stopped_at`` and ``step_at_resume`` (both
    ``stop_after`` when the stop worked), ``straight`` and ``resumed`` (this rank's
    :func:`parameter_checksums`), ``plugins`` (the resumed run's objects, by name) and, on
    rank 0, ``straight_metrics`` and ``resumed_metrics``. A resumed run continues exactly when
    the checksums and the metrics are equal.
    """
    root = Path(dump_folder)
    fresh = plugins if plugins is not None else tuple
    straight = make_trainer(root / "straight", *args, steps=steps, plugins=fresh())
    straight.run()
    checkpointed = (
        "--checkpoint.enable", "true", "--checkpoint.interval", str(steps),
        "--checkpoint.async_mode", "disabled", *args,
    )  # fmt: skip
    stop = [*fresh(), ("sigterm", SigtermAt(stop_after, sigterm_rank))]
    first = make_trainer(root / "resumed", *checkpointed, steps=steps, plugins=stop)
    first.run()
    resumed_plugins = list(fresh())
    second = make_trainer(root / "resumed", *checkpointed, steps=steps, plugins=resumed_plugins)
    step_at_resume = second.step
    second.run()
    result: dict[str, Any] = {
        "rank": second.parallel_dims.rank,
        "stopped_at": first.step,
        "step_at_resume": step_at_resume,
        "straight": parameter_checksums(straight.model),
        "resumed": parameter_checksums(second.model),
        "plugins": dict(resumed_plugins),
    }
    if second.parallel_dims.is_main:
        result["straight_metrics"] = read_metrics(root / "straight")
        result["resumed_metrics"] = read_metrics(root / "resumed")
    return result
