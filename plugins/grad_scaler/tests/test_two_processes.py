"""grad_scaler on 2 real processes with FSDP2 (gloo on loopback)."""

from __future__ import annotations

import grad_scaler_testing as gst
import pytest
from distributed import run_distributed

pytestmark = pytest.mark.slow


def test_inf_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    results = run_distributed(gst.inf_on_one_rank, 2, str(tmp_path))
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
    results = run_distributed(gst.compare_scaler_classes, 2, str(tmp_path))
    for rank_result in results:
        plain, sharded = rank_result["GradScaler"], rank_result["ShardedGradScaler"]
        assert plain == {"collectives": 1, "found_inf": 1.0, "update_syncs": 0, "scale": 512.0}
        assert sharded["collectives"] == 2
        assert sharded["found_inf"] == 2.0
        assert sharded["update_syncs"] >= 1
        assert sharded["scale"] == 512.0
