"""FSDP2 on several real processes (gloo on loopback): one 2-rank session trains every scenario,
and each test asserts on its records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plugtrain.plugin import StepContext, hookimpl, local_tensor
from plugtrain.testing import StepWatcher, make_trainer, read_metrics, run_distributed

pytestmark = pytest.mark.slow

GLOBAL_BATCH = [
    "--training.batch_size", "8", "--validation.interval", "6", "--validation.steps", "2",
]  # fmt: skip
"""The run that 1 and 2 processes must agree on: 6 steps of a global batch of 8, validated."""
DTYPES = ("float32", "bfloat16", "float16")


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the rank-local part of each tensor (a DTensor's local shard)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


class ShardBytes:
    """Records the bytes of this rank's gradient shards once they are complete."""

    def __init__(self) -> None:
        self.grad_bytes = 0

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        self.grad_bytes = tensor_bytes(ctx.gradients())


def global_batch_run(dump_folder: Path) -> dict:
    """Train GLOBAL_BATCH on this world; the bytes this rank holds of each kind of tensor."""
    probe = ShardBytes()
    trainer = make_trainer(dump_folder, *GLOBAL_BATCH, steps=6, plugins=[("bytes", probe)])
    trainer.run()
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "param_bytes": tensor_bytes(list(trainer.model.parameters())),
        "grad_bytes": probe.grad_bytes,
        "optimizer_state_bytes": tensor_bytes(state),
    }


def every_scenario(root: str) -> dict:
    """Run on each rank: the global-batch run, 12 steps in each parameter dtype, and a run whose
    step 2 hook_recorder vetoes; what each did on this rank."""
    base = Path(root)
    result: dict = {"bytes": global_batch_run(base / "two")}
    for dtype in DTYPES:
        args = ["--training.mixed_precision_param", dtype, "--training.batch_size", "8"]
        make_trainer(base / dtype, *args, "--optimizer.lr", "0.01", steps=12).run()
    watcher = StepWatcher()
    veto = ["--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[2]"]
    trainer = make_trainer(base / "veto", *veto, plugins=[("watcher", watcher)])
    watcher.trainer = trainer
    trainer.run()
    result.update(
        changed=watcher.changed, lr_steps=watcher.lr_steps, rank=trainer.parallel_dims.rank
    )
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every scenario on 2 ranks, and the global-batch run on this one process."""
    root = tmp_path_factory.mktemp("distributed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = global_batch_run(root / "one")
    finally:
        torch.set_num_threads(threads)
    return {"root": root, "one": one, "ranks": run_distributed(every_scenario, 2, str(root))}


def losses(dump_folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(dump_folder) if "loss" in r]


def test_two_processes_match_one_process_of_the_same_global_batch(runs):
    root = runs["root"]
    l1, l2 = losses(root / "one"), losses(root / "two")
    assert len(l1) == len(l2) == 6
    assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-5)
    assert l1[0] != l1[-1]
    (v1,), (v2,) = ([r for r in read_metrics(root / n) if "validation_loss" in r]
                    for n in ("one", "two"))  # fmt: skip
    assert set(v1) == set(v2) == {"step", "validation_loss", "validation_bpb"}
    assert v2 == pytest.approx(v1, rel=1e-6)  # the same batches, split over the ranks


def test_fsdp2_shards_parameters_gradients_and_optimizer_state(runs):
    """The two ranks' shards add up to the single process's tensors, and each holds about half
    (bench/scaling.py measures the same on larger models)."""
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
        total = runs["one"][key]
        shards = [r["bytes"][key] for r in runs["ranks"]]
        assert sum(shards) == total > 0, key
        assert all(0.4 * total < s < 0.6 * total for s in shards), (key, shards)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_parameter_dtype_trains_on_two_processes(runs, dtype):
    trained = losses(runs["root"] / dtype)
    assert len(trained) == 12
    assert trained[-1] < trained[0] - 0.5, trained


def test_veto_leaves_parameters_and_schedule_unchanged_on_every_rank(runs):
    assert [r["rank"] for r in runs["ranks"]] == [0, 1]
    for r in runs["ranks"]:
        assert r["changed"] == {1: True, 2: False, 3: True}, r
        assert r["lr_steps"] == {1: 1, 2: 1, 3: 2}, r
