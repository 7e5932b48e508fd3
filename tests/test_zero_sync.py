"""Zero host syncs per non-logging step: the core (causal or document masking), grad_clip and
grad_scaler, the moe family's balancing, 1 and 2 processes.

A run of N steps logs at step 1 and step N only (``metrics.log_freq`` larger than N). Counted
over two runs of different lengths, the difference is what the extra non-logging steps cost:
it must be 0 host syncs, whatever the plugins.
"""

from __future__ import annotations

import pytest

from plugtrain.testing import Costs, count_costs, run_distributed
from plugtrain.training.trainer import Trainer

SHORT, LONG = 3, 6
DECLARED = {
    "core fp32": {},
    "document masking fp32": {},
    "grad_clip fp32": {"_c10d_functional.all_reduce": 1},  # the global norm
    "grad_clip bf16": {"_c10d_functional.all_reduce": 1},
    # and the scaler's found_inf, reduced by DTensor inside its unscale kernel
    "grad_clip+grad_scaler fp16": {"_c10d_functional.all_reduce": 2},
    # the experts' loads summed over the ranks: for the aux loss's f, for the bias update
    "moe balanced fp32": {"c10d.allreduce_": 2},
}
"""The collectives each case adds to the core's per non-logging step, as the plugins declare."""
CASES = {
    "core fp32": ("--training.mixed_precision_param", "float32"),
    "document masking fp32": ("--model.attention", "document"),
    "grad_clip fp32": ("--plugins.enabled", "grad_clip"),
    "grad_clip bf16": (
        "--plugins.enabled", "grad_clip", "--training.mixed_precision_param", "bfloat16",
    ),
    "grad_clip+grad_scaler fp16": (
        "--plugins.enabled", "grad_clip,grad_scaler",
        "--training.mixed_precision_param", "float16",
    ),
    "moe balanced fp32": (
        "--model.family", "moe", "--model.flavor", "debug_moe",
        "--model.moe_bias_update_rate", "0.001", "--model.moe_aux_loss_weight", "0.01",
        "--model.moe_z_loss_weight", "0.001",
    ),
}  # fmt: skip


def per_extra_step(dump_folder: str, *args: str) -> Costs:
    """Syncs and collectives of the LONG - SHORT extra, non-logging steps, per step."""
    return count_costs(dump_folder, *args, short=SHORT, long=LONG)


def all_cases(dump_folder: str) -> dict:
    return {name: per_extra_step(f"{dump_folder}/{i}", *args) for i, (name, args) in enumerate(
        CASES.items())}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_no_host_sync_on_a_non_logging_step_one_process(tmp_path, case):
    costs = per_extra_step(str(tmp_path), *CASES[case])
    assert costs.syncs == 0, costs.sync_sites
    assert costs.collectives == {}  # a world of one needs none


def test_the_counting_sees_a_sync_in_the_step(tmp_path, monkeypatch):
    """The control: one host read per step, in the core's own step, is counted as 1."""
    step = Trainer.train_step

    def reading_step(self, batch):
        loss, ctx = step(self, batch)
        loss.item()
        return loss, ctx

    monkeypatch.setattr(Trainer, "train_step", reading_step)
    assert per_extra_step(str(tmp_path)).syncs == 1


@pytest.mark.slow
def test_no_host_sync_on_a_non_logging_step_two_processes(tmp_path):
    ranks = run_distributed(all_cases, 2, str(tmp_path))
    for rank, cases in enumerate(ranks):
        core = cases["core fp32"].collectives
        for name, costs in cases.items():
            assert costs.syncs == 0, (rank, name, costs.sync_sites)
            added = {op: n - core.get(op, 0) for op, n in costs.collectives.items()}
            added = {op: n for op, n in added.items() if n}
            assert added == DECLARED[name], (rank, name, added)
        # The core's own: FSDP2's all-gathers and reduce-scatters, and the stop vote.
        assert core.get("c10d.allreduce_") == 1, (rank, core)
