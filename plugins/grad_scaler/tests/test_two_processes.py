"""grad_scaler on 2 real processes with FSDP2 (gloo on loopback)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.profiler import ProfilerActivity, profile

from plugtrain.plugin import StepContext, hookimpl
from plugtrain.testing import (
    InjectInf,
    StepWatcher,
    make_trainer,
    poison,
    run_distributed,
)

FP16 = ("--training.mixed_precision_param", "float16")


class ScaleWatcher(StepWatcher):
    """A :class:`StepWatcher` that also keeps the loss scale once each step is over."""

    def __init__(self) -> None:
        super().__init__()
        self.scales: dict[int, float] = {}

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> None:
        # Fires after every post_step (log_freq 1), so after the scaler's update.
        self.scales[ctx.step] = self.trainer.host.get("grad_scaler").scale.item()


def inf_on_one_rank(dump_folder: str) -> dict:
    """Run on each rank: 3 fp16 steps with grad_scaler; inf in rank 1's gradient shard at
    step 2."""
    watcher = ScaleWatcher()
    trainer = make_trainer(
        dump_folder, *FP16, "--plugins.enabled", "grad_scaler",
        "--grad_scaler.init_scale", "1024",
        plugins=[("inject", InjectInf(steps={2}, ranks={1})), ("watcher", watcher)],
    )  # fmt: skip
    watcher.trainer = trainer
    trainer.run()
    return {
        "rank": trainer.parallel_dims.rank,
        "params_changed": watcher.changed,
        "state_changed": watcher.state_changed,
        "scales": watcher.scales,
        "lr_steps": int(trainer.lr_scheduler.applied_steps),
        "skipped": int(trainer.host.get("grad_scaler").skipped_steps),
    }


def compare_scaler_classes(dump_folder: str) -> dict:
    """Run on each rank: unscale_ and update of GradScaler and ShardedGradScaler on the
    trainer's FSDP2 model, inf in rank 1's shard only: collectives, found_inf and host syncs
    seen on this rank."""
    trainer = make_trainer(dump_folder, *FP16)
    (inputs, targets, *_), *_ = trainer.batches.next_batch()
    out = {}
    for cls in (torch.amp.GradScaler, ShardedGradScaler):
        scaler = cls("cpu", init_scale=1024.0)
        scaler.scale(trainer.loss.fn(trainer.model(inputs), targets)).backward()
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


pytestmark = pytest.mark.slow


def test_inf_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    results = run_distributed(inf_on_one_rank, 2, str(tmp_path))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        # Rank 0's shard was finite, yet it skips with rank 1: found_inf is global.
        assert r["params_changed"] == {1: True, 2: False, 3: True}, r
        assert r["state_changed"] == {1: True, 2: False, 3: True}, r
        assert r["scales"] == {1: 1024.0, 2: 512.0, 3: 512.0}, r
        assert r["lr_steps"] == 2, r
        assert r["skipped"] == 1, r


def test_choice_of_grad_scaler_class(tmp_path):
    """The evidence behind torch.amp.GradScaler over ShardedGradScaler (the plugin's setup).

    With FSDP2's DTensor gradients, GradScaler.unscale_ already all-reduces found_inf once (in
    DTensor's dispatcher), so both ranks see the inf of rank 1's shard. ShardedGradScaler adds
    its own all-reduce on top (a sum of the already-global flag: 2.0), and its CPU update reads
    the flag with .item() where GradScaler's update stays on the device.
    """
    results = run_distributed(compare_scaler_classes, 2, str(tmp_path))
    for rank_result in results:
        plain, sharded = rank_result["GradScaler"], rank_result["ShardedGradScaler"]
        assert plain == {"collectives": 1, "found_inf": 1.0, "update_syncs": 0, "scale": 512.0}
        assert sharded["collectives"] == 2
        assert sharded["found_inf"] == 2.0
        assert sharded["update_syncs"] >= 1
        assert sharded["scale"] == 512.0
