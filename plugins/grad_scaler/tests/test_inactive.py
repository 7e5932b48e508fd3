"""Under bfloat16 and float32 the enabled plugin costs exactly nothing (float16 is the control)."""

from __future__ import annotations

import json

import grad_scaler_testing as gst
import pytest
import torch
from distributed import run_distributed
from grad_scaler_testing import PROFILED_STEPS, SYNC, UNSCALE, profiled_run


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_no_checks_no_syncs_no_state_same_parameters(tmp_path, dtype):
    plain, plain_ops = profiled_run(tmp_path / "plain", dtype)
    auto, auto_ops = profiled_run(tmp_path / "auto", dtype, "--plugins.enabled", "grad_scaler")
    assert "grad_scaler" not in auto.host.names()  # deactivated in setup
    assert "grad_scaler" not in auto.host.call_each("state_dict")  # nothing to checkpoint
    assert auto_ops[UNSCALE] == 0
    assert auto_ops[SYNC] == plain_ops[SYNC]
    run = json.loads((tmp_path / "auto" / "run.json").read_text())
    assert run["plugins"]["grad_scaler"]["inactive"] == (
        f"grad_scaler: {dtype} needs no loss scaling, inactive"
    )
    for (name, a), b in zip(auto.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


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
    for rank_counts in run_distributed(gst.count_collectives, 2, str(tmp_path)):
        for dtype in ("bfloat16", "float32"):
            plain, auto = rank_counts[dtype, False], rank_counts[dtype, True]
            assert plain and auto == plain, dtype
        plain, auto = rank_counts["float16", False], rank_counts["float16", True]
        # The control: float16's found_inf all-reduce, once per step.
        assert auto["c10d::allreduce_"] == plain["c10d::allreduce_"] + PROFILED_STEPS
