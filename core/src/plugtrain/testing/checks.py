"""Checks of what runs cost and do: syncs and collectives per step, order, steps, memory.

:func:`count_costs` and :func:`assert_costs` (host syncs, collectives and time per non-logging
step, of the whole step or of one plugin's hooks); :func:`check_order_independence` (the same
parameters bitwise whatever the plugin's position among the enabled plugins);
:class:`StepWatcher` (whether each step changed the parameters and the optimizer state);
:class:`PeakMemory` (the peak bytes of the tensors ops create); :func:`saved_activation_bytes`
(the bytes a training forward keeps for its backward).
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plugtrain.data import MicroBatch
from plugtrain.plugin import StepContext, hookimpl, local_tensor
from plugtrain.testing.runs import Plugins, Trainer, make_trainer, parameter_checksums


@dataclass
class Costs:
    """What each extra, non-logging step cost, as :func:`count_costs` measured it."""

    syncs: float
    """Host syncs per step."""
    collectives: dict[str, float]
    """Collectives per step, by op (``"_c10d_functional.all_reduce"``); ops that cost 0 left out."""
    ms: float | None
    """Milliseconds per step in the plugin's hooks (None for a whole-step count)."""
    sync_sites: list[str]
    """Where the extra syncs happened (``"Tensor.item at module:line (function)"``)."""

    @property
    def num_collectives(self) -> float:
        """Collectives per step, all ops together."""
        return sum(self.collectives.values())


def _counted_run(
    dump_folder: Path, steps: int, args: Sequence[str], plugins: Plugins, plugin: str | None
) -> tuple[Counter[str], Counter[str], float]:
    from plugtrain.observability import CostCounter

    argv = [*args, "--metrics.log_freq", "1000"]
    if plugin is not None:
        argv += ["--metrics.trace_hooks", "true"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        trainer = make_trainer(dump_folder, *argv, steps=steps, plugins=plugins)
    if plugin is None:
        with CostCounter() as costs:
            trainer.run()
        return costs.sync_sites, costs.collectives, 0.0
    trainer.run()
    trace = dump_folder / f"hook_trace.rank{trainer.parallel_dims.rank}.jsonl"
    summary = json.loads(trace.read_text().splitlines()[-1])["summary"]
    sites: Counter[str] = Counter()
    collectives: Counter[str] = Counter()
    ms = 0.0
    for totals in summary["plugins"].get(plugin, {}).values():
        sites.update(totals.get("sync_sites", {}))
        collectives.update(totals.get("collective_ops", {}))
        ms += totals["ms"]
    return sites, collectives, ms


def count_costs(
    dump_folder: str | Path,
    *args: str,
    plugin: str | None = None,
    plugins: Plugins = (),
    short: int = 3,
    long: int = 6,
) -> Costs:
    """Host syncs, collectives (and time) per non-logging step, of a whole step or of the
    hooks of ``plugin``.

    Two runs of ``short`` and ``long`` steps log at their first and last steps only; the
    difference of their counts, over ``long - short``, is what one more non-logging step costs,
    so set-up, logging steps and the end of the run cancel out. With ``plugin`` (a registered
    plugin's name) only that plugin's hook implementations count, through the hook trace
    (``metrics.trace_hooks``); without, everything the step does counts (a
    :class:`~plugtrain.observability.costs.CostCounter` around ``train()``). Call it on
    every rank for a multi-process count (each rank counts its own).
    """
    folder = Path(dump_folder)
    s_sites, s_coll, s_ms = _counted_run(folder / "short", short, args, plugins, plugin)
    l_sites, l_coll, l_ms = _counted_run(folder / "long", long, args, plugins, plugin)
    extra = long - short
    l_coll.subtract(s_coll)
    sites = l_sites.copy()
    sites.subtract(s_sites)
    return Costs(
        syncs=(l_sites.total() - s_sites.total()) / extra,
        collectives={op: n / extra for op, n in l_coll.items() if n},
        ms=(l_ms - s_ms) / extra if plugin is not None else None,
        sync_sites=sorted(site for site, n in sites.items() if n > 0),
    )


def assert_costs(
    costs: Costs,
    *,
    syncs: float | None = 0,
    collectives: dict[str, float] | None = None,
    max_ms: float | None = None,
) -> None:
    """Fail unless ``costs`` are as declared: ``syncs`` host syncs per step, exactly the
    ``collectives`` by op (``{}`` for none; None: not checked), at most ``max_ms``."""
    if syncs is not None and costs.syncs != syncs:
        raise AssertionError(
            f"{costs.syncs:g} host syncs per non-logging step, expected {syncs:g}; "
            f"at: {costs.sync_sites}"
        )
    if collectives is not None and costs.collectives != collectives:
        raise AssertionError(
            f"collectives per non-logging step: {costs.collectives}, expected {collectives}"
        )
    if max_ms is not None and (costs.ms is None or costs.ms > max_ms):
        raise AssertionError(f"{costs.ms} ms per non-logging step, expected at most {max_ms}")


def check_order_independence(
    dump_folder: str | Path,
    plugin: str | tuple[str, Callable[[], object]],
    *args: str,
    others: Sequence[str] = (),
    steps: int = 3,
) -> list[str]:
    """Train once with ``plugin`` in every position among the ``others`` (installed plugins'
    names); fail unless the parameters are bitwise equal. Returns the checksum.

    ``plugin`` is an installed plugin's name or ``(name, factory)``, a fresh object per run.
    The registration order is set exactly (:func:`make_trainer`), so each position is one the
    contract allows; ``args`` go to every run.
    """
    name = plugin if isinstance(plugin, str) else plugin[0]
    installed = [*others, name] if isinstance(plugin, str) else list(others)
    enabled = ("--plugins.enabled", ",".join(installed)) if installed else ()
    sums: dict[tuple[str, ...], str] = {}
    for position in range(len(others) + 1):
        order = [*others[:position], name, *others[position:]]
        registered = [
            (n, plugin[1]() if n == name and not isinstance(plugin, str) else None) for n in order
        ]
        trainer = make_trainer(
            Path(dump_folder, str(position)), *enabled, *args, steps=steps, plugins=registered
        )
        trainer.run()
        sums[tuple(order)] = parameter_checksums(trainer.model)
    if len(set(sums.values())) > 1:
        raise AssertionError(f"the parameters depend on the registration order: {sums}")
    return sorted(set(sums.values()))


class StepWatcher:
    """Records, per step on this rank, whether the parameter shards and the optimizer state
    changed, and the LR schedule's count of applied steps.

    Set :attr:`trainer` before training (it reads the optimizer and the LR schedule). Its
    comparisons read tensors on the host: do not count costs with it registered.
    """

    def __init__(self, trainer: Trainer | None = None) -> None:
        self.trainer = trainer
        self.before: list[torch.Tensor] = []
        self.changed: dict[int, bool] = {}
        """Whether the step changed this rank's parameter shards."""
        self.state_changed: dict[int, bool] = {}
        """Whether it changed the optimizer state (created counts as changed: AdamW's first)."""
        self.lr_steps: dict[int, int] = {}
        """The LR schedule's applied steps after the step."""

    def _snapshot(self, ctx: StepContext) -> list[torch.Tensor]:
        tensors = [p.detach() for p in ctx.params]
        tensors += [v for state in ctx.optimizer.state.values() for v in state.values()]
        return [local_tensor(t).clone() for t in tensors]

    @hookimpl
    def pre_step(self, ctx: StepContext) -> None:
        self.before = self._snapshot(ctx)

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        after = self._snapshot(ctx)
        n = len(ctx.params)
        same = [torch.equal(a, b) for a, b in zip(self.before, after, strict=False)]
        self.changed[ctx.step] = not all(same[:n])
        self.state_changed[ctx.step] = len(after) != len(self.before) or not all(same[n:])
        if self.trainer is not None:
            self.lr_steps[ctx.step] = int(self.trainer.lr_scheduler.applied_steps)


class PeakMemory(TorchDispatchMode):
    """The peak bytes of the tensors that ops create while it is on, on any device.

    ``with PeakMemory() as memory: ...`` then ``memory.peak``: the CPU's stand-in for
    ``torch.cuda.max_memory_allocated``, counting each storage an op returns from its creation
    until it is freed (tensors that existed before, such as parameters, are not counted).
    Activation memory is what it tells apart: a forward and backward under it peaks at the
    activations kept for backward, plus the gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        """Bytes alive now."""
        self.peak = 0
        """The most bytes alive at once."""
        self._seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:  # a view of a counted tensor is not new memory
                    self._seen.add(storage)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def saved_activation_bytes(trainer: Trainer, microbatch: MicroBatch) -> int:
    """The bytes one training forward of ``microbatch`` (this rank's part of it under context
    parallelism) keeps for its backward on this rank: every tensor autograd saves, each once,
    the parameters (their gathered copies, and views of them) left out. Deterministic, unlike
    a peak: the CPU's measure of activation memory."""
    part = trainer.runner.context_part(microbatch)
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a matmul saves its weight's transpose
        if not (base.is_leaf and base.requires_grad):  # a parameter is no activation
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.loss.forward(trainer.model, part)
    return sum(seen.values())
