"""Checkpoint scenarios run in-process (a world of one) or on each rank by ``run_distributed``.

Every function here is module level (picklable) and returns plain data for the test to check.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from conftest import read_metrics
from runs import tiny_args

from plugtrain.plugin import SetupContext, StepContext, hookimpl
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

K = 4
"""Steps before the interruption; every scenario trains 2K steps in all."""


class Counter:
    """A stateful plugin: counts steps in a Python int and sums them in a tensor."""

    def __init__(self) -> None:
        self.count = 0
        self.total = torch.zeros((), dtype=torch.float64)
        self.loaded: list[dict] = []

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        self.count += 1
        self.total += ctx.step

    @hookimpl
    def state_dict(self) -> dict:
        return {"count": self.count, "nested": {"total": self.total}}

    @hookimpl
    def load_state_dict(self, state_dict: dict) -> None:
        self.count, self.total = state_dict["count"], state_dict["nested"]["total"]
        self.loaded.append({"count": self.count, "total": self.total.item()})


class Stateless:
    """Implements load_state_dict but saves nothing: it must never be asked to load."""

    def __init__(self) -> None:
        self.loaded = 0

    @hookimpl
    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded += 1


class Dormant:
    """Has state but deactivates itself in setup: it must contribute nothing."""

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        ctx.deactivate(self, "dormant: nothing to do")

    @hookimpl
    def state_dict(self) -> dict:
        raise AssertionError("a deactivated plugin's state_dict was called")


class SigtermAt:
    """Sends SIGTERM to its own process on rank ``rank`` so that the run stops after ``step``.

    On several processes the ranks' stop vote reads a step late (it never makes a step wait:
    see training/stop.py), so the signal goes out mid-step ``step - 1`` there.
    """

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank, self.my_rank = step, rank, -1

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.my_rank = ctx.rank
        self.step -= ctx.world_size > 1

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        if ctx.step == self.step and self.my_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (collective), by name."""
    return {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters()}


def build(dump_folder: Path, *args: str, plugins: dict | None = None) -> Trainer:
    config, host = configure([*tiny_args(dump_folder, steps=2 * K), *args])
    for name, plugin in (plugins or {}).items():
        host.register(plugin, name)
    return Trainer(config, host)


def run(trainer: Trainer) -> Trainer:
    trainer.train()
    trainer.close()
    return trainer


def interrupted_and_resumed(
    root: str, dtype: str, async_mode: str, sigterm_rank: int, extra: tuple[str, ...] = ()
) -> dict:
    """Train 2K steps straight (no checkpoints), then K steps stopped by a SIGTERM that only
    rank ``sigterm_rank`` gets mid-step, then resume to 2K; ``extra`` arguments go to every
    run. Rank 0 returns what to compare."""
    torch.set_num_threads(1)
    root_path = Path(root) / f"{dtype}-{async_mode}"
    args = ["--training.mixed_precision_param", dtype, *extra]
    straight = run(build(root_path / "straight", *args, plugins={"counter": Counter()}))
    ckpt = [
        *args,
        "--checkpoint.enable", "true",
        "--checkpoint.interval", "3",  # due at 3 and 6 only: the stop at K is the SIGTERM's
        "--checkpoint.async_mode", async_mode,
    ]  # fmt: skip
    resumed_folder = root_path / "resumed"
    first = run(
        build(
            resumed_folder,
            *ckpt,
            plugins={"counter": Counter(), "sigterm": SigtermAt(K, sigterm_rank)},
        )
    )
    saved_after_stop = sorted(p.name for p in (resumed_folder / "checkpoints").iterdir())
    plugins = {"counter": Counter(), "stateless": Stateless(), "dormant": Dormant()}
    second = build(resumed_folder, *ckpt, plugins=plugins)
    step_at_resume = second.step
    run(second)
    result = {
        "stopped_at": first.step,
        "saved_after_stop": saved_after_stop,
        "step_at_resume": step_at_resume,
        "counter_loaded": plugins["counter"].loaded,
        "counter_final": plugins["counter"].count,
        "stateless_loaded": plugins["stateless"].loaded,
        "straight_params": full_parameters(straight),
        "resumed_params": full_parameters(second),
        "rank": second.world.rank,
    }
    if second.world.is_main:
        result["straight_records"] = read_metrics(root_path / "straight")
        result["resumed_records"] = read_metrics(resumed_folder)
    return result


TWO_RANK_SCENARIOS = [("float32", "disabled"), ("bfloat16", "async"), ("float16", "disabled")]


def two_rank_scenarios(root: str) -> list[dict]:
    """:func:`interrupted_and_resumed` for each of TWO_RANK_SCENARIOS, SIGTERM on rank 1 only."""
    return [interrupted_and_resumed(root, d, m, 1) for d, m in TWO_RANK_SCENARIOS]
