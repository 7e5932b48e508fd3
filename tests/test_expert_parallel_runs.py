"""Expert parallelism in training runs of the ``moe`` family: EP 2 on 2 processes and EP 2 x
FSDP 2 on 4 against one process over 20 steps (fp32; grad_clip, ema, spike_guard and muon, its
matrices the experts' stacks too), the global grad norm on every rank, checkpoints across EP
layouts (saved at EP 2, resumed on one process and at EP 4), and an ep the experts refuse.

The runs are shared through a module-scoped fixture: one launch of 2 processes, one of 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from plugtrain.errors import ConfigError
from plugtrain.testing import (
    GradNorms,
    copy_checkpoint,
    make_trainer,
    metrics_by_step,
    relative,
    run_distributed,
    tiny_args,
)
from plugtrain.training import check_world, configure

STEPS, SAVED = 20, 10
RUN = (
    "--model.family", "moe",
    "--model.flavor", "debug_moe",
    "--training.batch_size", "8",
    "--plugins.enabled", "grad_clip,ema,spike_guard,muon",
    "--muon.ns_dtype", "float32",
    "--spike_guard.warmup_steps", "3",
    "--checkpoint.enable", "true",
    "--checkpoint.interval", str(SAVED),
    "--validation.interval", str(STEPS),
    "--validation.steps", "2",
)  # fmt: skip
COMPARED = (
    "loss",
    "spike_guard/window_mean.loss",
    "validation_loss",
    "ema/validation_loss",
)
"""Metrics every layout must give as one process does (within ``LOSS_TOLERANCE``)."""
LOSS_TOLERANCE = 1e-6
"""Relative; measured: 1.8e-7 (EP 2, EP 2 x FSDP 2 against one process; resumed), with Muon's
iteration in float32 (in bfloat16 it rounds the layouts' last-bit gradient differences to
whole bfloat16 steps: 2.7e-4 over 20 steps)."""
NORM_TOLERANCE = 3e-5
"""The grad norms' relative tolerance against one process; measured: 1.2e-5 (EP 2), 1.7e-5
(EP 2 x FSDP 2), 1.2e-5 and 5.3e-6 (resumed on one process, at EP 4). torch's fp32 norm kernel
on CPU rounds a sum of squares by about that much (the 1-process norm of this model's first
gradient is 1.5e-5 from its float64 value), and a norm over shards sums other partial sums;
the gradients themselves agree within 1e-6 (tests/test_expert_parallel.py), and FSDP 2
without EP gives EP 2's norms (equal at step 1, 7e-8 at step 2)."""


def train(folder: Path, *args: str) -> dict[int, float]:
    """Train a run of ``RUN`` + ``args``; this rank's grad norms by step."""
    log = GradNorms()
    trainer = make_trainer(folder, *RUN, *args, steps=STEPS, plugins=[("norm_log", log)])
    log.watch(trainer)
    muon = trainer.optimizer.param_groups[0]
    assert muon["muon"] and sum(p.ndim == 3 for p in muon["params"]) == 2 * 3  # the experts
    trainer.run()
    return log.norms


def resume(written: Path, resumed: Path, *args: str) -> dict[int, float]:
    """Resume run ``written``'s step-``SAVED`` checkpoint in the new dump folder ``resumed``."""
    copy_checkpoint(written, resumed, SAVED)
    return train(resumed, *args)


def two_ranks(base: str) -> dict:
    return train(Path(base) / "ep2", "--parallelism.ep", "2")


def four_ranks(base: str) -> dict:
    root = Path(base)
    return {
        "ep2xfsdp2": train(root / "ep2xfsdp2", "--parallelism.ep", "2"),
        "ep2_to_ep4": resume(root / "ep2", root / "ep2_to_ep4", "--parallelism.ep", "4"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("ep")
    one = train(base / "one")
    two = run_distributed(two_ranks, 2, str(base))
    four = run_distributed(four_ranks, 4, str(base))
    return {
        "base": base,
        "norms": {
            "one": [one],
            "ep2": two,
            "ep2xfsdp2": [r["ep2xfsdp2"] for r in four],
            "ep2_to_ep4": [r["ep2_to_ep4"] for r in four],
            "ep2_to_one": [resume(base / "ep2", base / "ep2_to_one")],
        },
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep2xfsdp2"])
def test_ep_layouts_train_as_one_process(runs, layout):
    metrics = {n: metrics_by_step(runs["base"] / n) for n in ("one", layout)}
    for step in range(1, STEPS + 1):
        for key in COMPARED:
            if key in metrics["one"][step]:
                ours, one = metrics[layout][step][key], metrics["one"][step][key]
                assert relative(ours, one) < LOSS_TOLERANCE, (step, key, ours, one)
    norms = runs["norms"]
    # Automodel #3816: the norm each EP group computes must be the global one, on every rank.
    assert all(rank == norms[layout][0] for rank in norms[layout])
    for step in range(1, STEPS + 1):
        assert relative(norms[layout][0][step], norms["one"][0][step]) < NORM_TOLERANCE


@pytest.mark.slow
def test_an_ep2_checkpoint_holds_every_expert_and_resumes_on_one_process_and_at_ep4(runs):
    base = runs["base"]
    # KempnerForge #202: one rank's experts saved. Every expert of every layer is here, whole.
    keys = dcp.FileSystemReader(str(base / "ep2" / f"checkpoints/step-{SAVED}")).read_metadata()
    saved = keys.state_dict_metadata.items()
    experts = {k: m.size for k, m in saved if k.startswith("model.") and ".experts.w" in k}
    assert len(experts) == 2 * 3 and {size[0] for size in experts.values()} == {8}, experts
    written = metrics_by_step(base / "ep2")
    norms = runs["norms"]
    for resumed in ("ep2_to_one", "ep2_to_ep4"):
        metrics = metrics_by_step(base / resumed)
        assert min(metrics) == SAVED + 1
        for step in range(SAVED + 1, STEPS + 1):
            for key in COMPARED:
                if key in written[step]:
                    ours, theirs = metrics[step][key], written[step][key]
                    assert relative(ours, theirs) < LOSS_TOLERANCE, (resumed, step, key)
            norm = norms[resumed][0][step]
            assert relative(norm, norms["ep2"][0][step]) < NORM_TOLERANCE, (resumed, step)
        assert all(rank == norms[resumed][0] for rank in norms[resumed])


def test_a_launch_refuses_an_ep_that_does_not_divide_the_experts(tmp_path):
    args = tiny_args(tmp_path, *RUN[:4], "--parallelism.ep", "3", "--training.batch_size", "6")
    config, _ = configure(args, "train.py")
    with pytest.raises(ConfigError) as refused:
        check_world(config, 3)
    assert str(refused.value) == (
        "parallelism.ep = 3 does not divide the model's 8 experts: choose an ep that divides 8 "
        "(or set model.moe_experts to a multiple of 3)"
    )
