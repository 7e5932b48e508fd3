"""Under bfloat16 and float32 the enabled plugin costs exactly nothing (float16 is the control)."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from plugtrain.plugin import full_tensor
from plugtrain.testing import Trainer, count_costs, make_trainer, run_distributed

PROFILED_STEPS = 2
UNSCALE = "aten::_amp_foreach_non_finite_check_and_unscale_"
SYNC = "aten::_local_scalar_dense"  # what .item() runs
ALL_REDUCE = "_c10d_functional.all_reduce"  # how the cost counter names a DTensor all-reduce


def profiled_run(dump_folder: str | Path, dtype: str, *args: str) -> tuple[Trainer, Counter]:
    """Train PROFILED_STEPS steps under the profiler; return the trainer and operator counts."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        trainer = make_trainer(
            dump_folder, "--training.mixed_precision_param", dtype, "--metrics.log_freq", "1000",
            *args, steps=PROFILED_STEPS,
        )  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.run()
    return trainer, Counter(e.name for e in prof.events())


def count_collectives(dump_folder: str) -> dict[tuple[str, bool], dict[str, float]]:
    """Run on each rank: the collectives per non-logging step, by op, by (dtype, whether
    grad_scaler is enabled). Counted with the test kit's cost counter rather than the
    profiler, which crashed one of two gloo processes now and then."""
    counts = {}
    for dtype in ("bfloat16", "float32", "float16"):
        for enabled in (False, True):
            args = ("--plugins.enabled", "grad_scaler") if enabled else ()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
                costs = count_costs(
                    Path(dump_folder, f"{dtype}-{enabled}"),
                    "--training.mixed_precision_param", dtype, *args,
                    short=1, long=2,
                )  # fmt: skip
            counts[dtype, enabled] = costs.collectives
    return counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_no_checks_no_syncs_no_state_same_parameters(tmp_path, dtype):
    # The process's first run makes one-off host reads (lazy initialisation) that would count
    # against whichever run came first.
    profiled_run(tmp_path / "warm-up", dtype)
    plain, plain_ops = profiled_run(tmp_path / "plain", dtype)
    auto, auto_ops = profiled_run(tmp_path / "auto", dtype, "--plugins.enabled", "grad_scaler")
    assert "grad_scaler" not in auto.host.names()  # deactivated in setup
    assert "grad_scaler" not in auto.host.results("state_dict")  # nothing to checkpoint
    assert auto_ops[UNSCALE] == 0
    assert auto_ops[SYNC] == plain_ops[SYNC]
    run = json.loads((tmp_path / "auto" / "run.json").read_text())
    assert run["plugins"]["grad_scaler"]["inactive"] == (
        f"grad_scaler: {dtype} needs no loss scaling, inactive"
    )
    for (name, a), b in zip(auto.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(full_tensor(a), full_tensor(b)), name


def test_the_profiler_sees_the_active_plugins_work(tmp_path):
    """The control that makes the test above able to fail: float16 shows the checks and syncs."""
    _, plain_ops = profiled_run(tmp_path / "plain", "float16")
    auto, auto_ops = profiled_run(tmp_path / "auto", "float16", "--plugins.enabled", "grad_scaler")
    assert "grad_scaler" in auto.host.names()
    run = json.loads((tmp_path / "auto" / "run.json").read_text())
    assert "inactive" not in run["plugins"]["grad_scaler"]
    assert plain_ops[UNSCALE] == 0
    # Per step, one foreach call over all (fp32) gradients: the DTensor op and its local kernel.
    assert auto_ops[UNSCALE] == 2 * PROFILED_STEPS
    # Its host syncs (none per step) are counted by tests/test_zero_sync.py.


@pytest.mark.slow
def test_no_extra_collectives_on_two_processes(tmp_path):
    """A world of one runs no collectives at all, so this needs two processes."""
    for rank_counts in run_distributed(count_collectives, 2, str(tmp_path)):
        for dtype in ("bfloat16", "float32"):
            plain, auto = rank_counts[dtype, False], rank_counts[dtype, True]
            assert plain and auto == plain, dtype
        plain, auto = rank_counts["float16", False], rank_counts["float16", True]
        # The control: float16's found_inf all-reduce, once per step.
        extra = {op: auto[op] - plain.get(op, 0) for op in auto if auto[op] != plain.get(op, 0)}
        assert extra == {ALL_REDUCE: 1}, extra
