"""Helpers for the grad_scaler plugin's tests: runs of the real trainer, an inf injector, and the
functions run on each rank by ``distributed.run_distributed`` (module level: picklable)."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import checkpoint_workers
import torch
import torch.distributed as dist
from runs import tiny_args
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.profiler import ProfilerActivity, profile

from plugtrain.plugin import StepContext, gradients, hookimpl, local_tensor
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer, cross_entropy

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

    A ``wrapper=True`` implementation of ``unscale_gradients``: its code before ``yield`` runs
    before every plain one, the scaler's unscaling included, whatever the registration order.
    """

    def __init__(self, steps: Collection[int], ranks: Collection[int] = (0,)) -> None:
        self.steps, self.ranks = set(steps), set(ranks)

    @hookimpl(wrapper=True)
    def unscale_gradients(self, ctx: StepContext):
        if ctx.step in self.steps and dist.get_rank() in self.ranks:
            poison(ctx.model)
        return (yield)


def read_metrics(dump_folder: str | Path) -> list[dict]:
    """The JSONL records a run wrote (rank 0), in order."""
    lines = (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


class StepWatcher:
    """Per step, on this rank: whether the parameter shards and the optimizer state changed,
    and the loss scale once the step is over."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.before: list[torch.Tensor] = []
        self.params_changed: dict[int, bool] = {}
        self.state_changed: dict[int, bool] = {}
        self.scales: dict[int, float] = {}

    def _snapshot(self) -> list[torch.Tensor]:
        assert self.trainer is not None
        opt = self.trainer.optimizer
        tensors = [p.detach() for p in self.trainer.model.parameters()]
        tensors += [v for state in opt.state.values() for v in state.values()]
        return [local_tensor(t).clone() for t in tensors]

    @hookimpl
    def pre_step(self) -> None:
        self.before = self._snapshot()

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        after = self._snapshot()
        n = len(list(self.trainer.model.parameters()))
        same = [torch.equal(a, b) for a, b in zip(self.before, after, strict=False)]
        self.params_changed[ctx.step] = not all(same[:n])
        # On the first step AdamW creates its state: "changed" means it now exists.
        self.state_changed[ctx.step] = len(after) != len(self.before) or not all(same[n:])

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> None:
        # Fires after every post_step (log_freq 1), so after the scaler's update.
        self.scales[ctx.step] = self.trainer.host.get("grad_scaler").scale.item()


def inf_on_one_rank(dump_folder: str) -> dict:
    """3 fp16 steps on 2 ranks with grad_scaler; inf in rank 1's gradient shard at step 2."""
    watcher = StepWatcher()
    trainer = make_trainer(
        dump_folder, *FP16, "--plugins.enabled", "grad_scaler",
        "--grad_scaler.init_scale", "1024",
        extra={"inject": InjectInf(steps={2}, ranks={1}), "watcher": watcher},
    )  # fmt: skip
    watcher.trainer = trainer
    trainer.train()
    trainer.close()
    return {
        "rank": trainer.world.rank,
        "params_changed": watcher.params_changed,
        "state_changed": watcher.state_changed,
        "scales": watcher.scales,
        "lr_steps": int(trainer.lr_scheduler.applied_steps),
        "skipped": int(trainer.host.get("grad_scaler").skipped_steps),
    }


def compare_scaler_classes(dump_folder: str) -> dict:
    """unscale_ and update of GradScaler and ShardedGradScaler on the trainer's FSDP2 model,
    inf in rank 1's shard only: collectives, found_inf and host syncs seen on this rank."""
    trainer = make_trainer(dump_folder, *FP16)
    (inputs, targets), *_ = trainer.batches.next_batch()
    out = {}
    for cls in (torch.amp.GradScaler, ShardedGradScaler):
        scaler = cls("cpu", init_scale=1024.0)
        scaler.scale(cross_entropy(trainer.model(inputs), targets)).backward()
        if dist.get_rank() == 1:
            poison(trainer.model)
        with profile(activities=[ProfilerActivity.CPU]) as unscale_prof:
            scaler.unscale_(trainer.optimizer)
        found_inf = sum(v.item() for v in scaler._found_inf_per_device(trainer.optimizer).values())
        with profile(activities=[ProfilerActivity.CPU]) as update_prof:
            scaler.update()
        trainer.optimizer.zero_grad(set_to_none=True)
        out[cls.__name__] = {
            "collectives": count_events(unscale_prof, "c10d::allreduce_"),
            "found_inf": found_inf,
            "update_syncs": count_events(update_prof, "aten::_local_scalar_dense"),
            "scale": scaler.get_scale(),
        }
    trainer.close()
    return out


def count_events(prof: torch.profiler.profile, name: str) -> int:
    """How many profiled operator calls are named ``name``."""
    return sum(1 for e in prof.events() if e.name == name)


PROFILED_STEPS = 2
UNSCALE = "aten::_amp_foreach_non_finite_check_and_unscale_"
SYNC = "aten::_local_scalar_dense"  # what .item() runs


def profiled_run(dump_folder: str | Path, dtype: str, *args: str) -> tuple[Trainer, Counter]:
    """Train PROFILED_STEPS steps under the profiler; return the trainer and operator counts."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        trainer = make_trainer(
            dump_folder, "--training.mixed_precision_param", dtype, "--metrics.log_freq", "1000",
            *args, steps=PROFILED_STEPS,
        )  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train()
    trainer.close()
    return trainer, Counter(e.name for e in prof.events())


def count_collectives(dump_folder: str) -> dict[tuple[str, bool], Counter]:
    """The collectives of profiled runs, by (dtype, whether grad_scaler is enabled)."""
    counts = {}
    for dtype in ("bfloat16", "float32", "float16"):
        for enabled in (False, True):
            args = ("--plugins.enabled", "grad_scaler") if enabled else ()
            _, ops = profiled_run(Path(dump_folder, f"{dtype}-{enabled}"), dtype, *args)
            counts[dtype, enabled] = Counter(
                {name: n for name, n in ops.items() if name.startswith("c10d::")}
            )
    return counts


RESUME_ARGS = ("--plugins.enabled", "grad_scaler", "--grad_scaler.init_scale", "1e6",
               "--grad_scaler.growth_interval", "2")  # fmt: skip
"""The scale too high at first: steps 1, 2 and 5 overflow and are skipped, the scale backs off
and grows again, so its state at the interruption is not its initial one."""


def interrupted_and_resumed(root: str, sigterm_rank: int) -> dict:
    """float16 with the scaler, stopped by SIGTERM and resumed (see the core's checkpoint
    workers), on every rank of the calling process group."""
    return checkpoint_workers.interrupted_and_resumed(
        root, "float16", "disabled", sigterm_rank, RESUME_ARGS
    )
