"""The CPU benchmarks run (--quick) and write the JSON fields docs/benchmarks/ documents.

Not part of the test suite (``python -m pytest`` collects ``tests`` and ``plugins``): these
are end-to-end runs of the bench scripts, minutes on 2 cores. Run them when a bench script or
what it measures changes: ``python -m pytest bench``. What they prove of plugtrain itself is
asserted in the suite too: the inactive scaler in ``plugins/grad_scaler/tests``, activation
checkpointing and compile in their plugins' tests, the KV cache's arithmetic in
``tests/test_decoding.py``, FSDP2's shards in ``tests/test_distributed.py``.

No timing is asserted: these machines are shared. What is asserted is what must hold on any
machine: the hand-written loop does the same work as plugtrain (equal losses), the inactive
scaler leaves the profile unchanged while the active one does not, FSDP2 splits the shards.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from plugtrain.testing import run_script

REPO = Path(__file__).resolve().parents[1]
RECORD_FIELDS = {"benchmark", "command", "args", "machine", "time", "results"}
MACHINE_FIELDS = {"cpu", "cpu_count", "torch_threads", "load_average", "python", "torch"}
SUMMARY_FIELDS = {"median", "q1", "q3", "min", "max", "n"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session", autouse=True)
def _data_cache(plugtrain_cache: Path) -> None:
    """The scripts prepare data into the session's cache, never the user's."""


def quick_results(name: str, tmp_path: Path, *args: str) -> dict:
    """Run ``bench/<name>.py --quick`` and return the ``results`` of the JSON it wrote."""
    out = tmp_path / f"{name}.json"
    script = REPO / "bench" / f"{name}.py"
    result = run_script(script, ["--quick", "--out", str(out), *args], timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "| " in result.stdout  # the printed table
    record = json.loads(out.read_text())
    assert set(record) == RECORD_FIELDS
    assert record["benchmark"] == name
    assert record["args"]["quick"] is True
    assert set(record["machine"]) >= MACHINE_FIELDS
    return record["results"]


def test_hook_overhead(tmp_path):
    results = quick_results("hook_overhead", tmp_path)
    cases = {c["case"]: c for c in results["cases"]}
    assert list(cases) == ["debug-bf16", "tiny-fp16"]
    assert cases["debug-bf16"]["plugins_active"] == ["grad_clip"]
    assert sorted(cases["tiny-fp16"]["plugins_active"]) == ["grad_clip", "grad_scaler"]
    for case in cases.values():
        assert case["losses_bitwise_equal"] is True, case["case"]
        assert case["rounds"] == 3
        assert set(case["skipped_in_timed_steps"]) == {"plugtrain", "hand_written", "control"}
        for measure in ("wall", "cpu"):
            m = case[measure]
            assert set(m["ratio"]) == SUMMARY_FIELDS and m["ratio"]["n"] == 3
            assert m["ratio"]["median"] > 0 and len(m["ratio_ci95"]) == 2
            assert {"a_seconds", "b_seconds", "ratio_of_medians", "control"} <= set(m)
            assert m["control"]["ratio"]["n"] == 3  # C/B: two identical hand-written loops
            assert isinstance(m["target_met"], bool) and isinstance(m["target_proven"], bool)
    # B and C on A's own model: one shared training state, so no loss comparison.
    args = ("--same-model", "--cases", "tiny-fp16")
    (same,) = quick_results("hook_overhead", tmp_path, *args)["cases"]
    assert same["same_model"] is True and same["losses_bitwise_equal"] is None
    assert same["cpu"]["ratio"]["n"] == 3


def assert_summary(summary: dict) -> None:
    assert set(summary) == SUMMARY_FIELDS
    assert 0 < summary["min"] <= summary["q1"] <= summary["median"] <= summary["q3"]
    assert summary["q3"] <= summary["max"]


def assert_difference(diff: dict, a: dict, b: dict) -> None:
    for key in ("min", "median"):
        assert diff[key] == pytest.approx(a[key] - b[key], rel=1e-9, abs=1e-9), key


def test_dispatch(tmp_path):
    results = quick_results("dispatch", tmp_path)
    assert results["target_us"] == 20.0
    assert [(r["plugins"], r["grad_accum_steps"]) for r in results["noop"]] == [
        (n, a) for n in (0, 2, 10) for a in (1, 4)
    ]
    for r in results["noop"]:
        # pre_backward per microbatch, then the 4 gradient phases and post_step.
        assert r["hook_calls_per_step"] == r["grad_accum_steps"] + 5
        assert_summary(r["us_per_step"])
        assert_summary(r["direct_call_us_per_step"])
        assert_difference(r["dispatch_us_per_step"], r["us_per_step"], r["direct_call_us_per_step"])
    shipped = {(r["dtype"], r["grad_accum_steps"]): r for r in results["shipped"]}
    assert shipped[("bfloat16", 1)]["active_plugins"] == ["grad_clip"]
    fp16 = shipped[("float16", 4)]
    assert sorted(fp16["active_plugins"]) == ["grad_clip", "grad_scaler"]
    assert fp16["hooks_implemented"]["grad_scaler"] == [
        "config_section", "setup", "pre_backward", "unscale_gradients", "pre_step",
        "post_step", "step_metrics", "state_dict", "load_state_dict",
    ]  # fmt: skip
    for r in results["shipped"]:
        assert r["hooks_implemented"]["grad_clip"] == [
            "config_section", "setup", "post_backward", "pre_step", "step_metrics",
        ]  # fmt: skip
        assert_difference(
            r["dispatch_us_per_step"], r["stand_ins_us_per_step"], r["stand_ins_direct_us_per_step"]
        )
        assert_difference(
            r["plugin_python_us_per_step"],
            r["plugin_bodies_us_per_step"],
            r["bare_torch_us_per_step"],
        )
        assert r["target_met"] == (r["dispatch_us_per_step"]["min"] < results["target_us"])


def test_inactive_scaler(tmp_path):
    results = quick_results("inactive_scaler", tmp_path)
    assert results["processes"] == 2
    for rank in results["ranks"]:
        by_dtype = {r["dtype"]: r for r in rank["dtypes"]}
        bf16, fp16 = by_dtype["bfloat16"], by_dtype["float16"]
        assert bf16["identical"] is True and bf16["differing_ops"] == {}
        assert bf16["inf_checks"] == {"without": 0, "with": 0}
        assert bf16["collectives"]["without"] == bf16["collectives"]["with"] > 0
        assert bf16["params_bitwise_equal"] is True
        # The control: the active scaler shows up, so the comparison can tell.
        assert fp16["identical"] is False
        assert fp16["inf_checks"]["without"] == 0 < fp16["inf_checks"]["with"]
        assert fp16["collectives"]["with"] > fp16["collectives"]["without"]


def test_scaling(tmp_path):
    results = quick_results("scaling", tmp_path)
    one, two = results["configs"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert len(one["ranks"]) == 1 and len(two["ranks"]) == 2
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
    # FSDP2 shards parameters, gradients and AdamW's state: the two ranks' shards add up to
    # the single process's tensors, and each holds about half.
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
        total = one["ranks"][0][key]
        shards = [r[key] for r in two["ranks"]]
        assert sum(shards) == total > 0, key
        assert all(0.4 * total < s < 0.6 * total for s in shards), (key, shards)


def test_data_scale(tmp_path):
    results = quick_results("data_scale", tmp_path)
    (corpus,) = results["corpora"]
    assert corpus["size_mb"] == 0.25 and corpus["tokens"] > 50_000
    for workers in ("1", "2"):
        prepared = corpus["prepare"][workers]
        assert prepared["mb_per_s"] > 0 and prepared["ratio_per_worker"] > 0
    for run in (corpus["train"], results["store"]["train"]):
        assert run["seconds"] > 0 and run["peak_rss_mb"] > 100
    assert results["store"]["tokens"] == 4_000_000
    assert 0 < results["data_share"] < 1


def test_transforms(tmp_path):
    results = quick_results("transforms", tmp_path)
    (ac,) = results["activation_checkpointing"]
    modes = {m["mode"]: m for m in ac["modes"]}
    assert list(modes) == ["full", "selective-op", "selective-layer"]
    for m in modes.values():
        assert m["bitwise_equal"] is True, m["mode"]
        assert 0 < m["peak_mib"] < ac["none_peak_mib"], m["mode"]
        assert m["time"]["ratio"]["n"] == 3
    assert modes["full"]["peak_mib"] < modes["selective-op"]["peak_mib"]
    for r in results["world_size_1"]:
        if r["dtype"] == "float32":  # bf16: FSDP2's casts against autocast's, not equal
            assert r["losses_equal_plain"] is True
        for key in ("plugtrain_vs_plain", "control_vs_plain", "fsdp_vs_plain"):
            assert r[key]["ratio"]["n"] == 3, key
    assert [r["dtype"] for r in results["compile"]] == ["float32"]
    for r in results["compile"]:
        assert r["backend"] == "aot_eager" and r["compile_seconds"] > 0
        assert r["max_loss_rel_diff"] < 1e-5


def test_export(tmp_path):
    (tiny,) = quick_results("export", tmp_path)
    assert tiny["flavor"] == "tiny" and tiny["parameters"] > 100_000
    assert 0 < tiny["largest_tensor_mib"] < tiny["model_mib"]
    for mode in ("stream", "hold"):
        assert tiny[mode]["seconds"] > 0 and tiny[mode]["peak_rss_mib"] > 100


def test_generate(tmp_path):
    results = quick_results("generate", tmp_path)
    assert results["same_tokens"] is True
    flops = results["flops"]
    # The KV cache's arithmetic is one forward's: every new token's matmuls once.
    assert flops["cached"] == pytest.approx(flops["one_forward"], rel=0.05)
    assert flops["uncached"] > 5 * flops["cached"]


def test_document_masking(tmp_path):
    results = quick_results("document_masking", tmp_path)
    assert [(f["split"], f["seq_len"]) for f in results["masked_pairs"]] == [
        ("train", 128),
        ("validation", 128),
    ]
    assert all(0 < f["masked_fraction"] < 0.01 for f in results["masked_pairs"])  # whole plays
    assert results["step_cost"]["step_cpu"]["ratio"]["n"] == 3


def test_roofline(tmp_path):
    (result,) = quick_results("roofline", tmp_path, "--thread-counts", "1")
    assert (result["case"], result["threads"]) == ("debug", 1)
    # The GEMMs are the model FLOPs less the norm weights' share of 6N.
    norms = 6 * result["tokens_per_step"] * (2 * 4 + 1) * 256  # debug: 4 layers, dim 256
    assert result["gemm_flops_per_step"] == result["model_flops_per_step"] - norms
    assert result["fraction_of_limit"]["ratio"]["median"] > 0
    # Ceiling (b): the machine's best square GEMM, at all threads or the case's.
    machine = result["machine_gemm"]
    assert machine["side"] == 1024 and machine["threads"] in {1, os.cpu_count()}
    achieved = [result["model_flops_per_step"] / s / 1e9 for s in result["step_seconds"]]
    assert result["fraction_of_machine"]["ratio"]["median"] == pytest.approx(
        statistics.median(achieved) / machine["gflops"]
    )
    split = result["profile_split"]
    assert list(split) == [
        "gemm", "attention", "loss", "optimizer", "other operators", "hooks", "unattributed",
    ]  # fmt: skip
    assert sum(split.values()) == pytest.approx(1.0)
    assert split["gemm"] > split["loss"] > 0 and split["optimizer"] > 0


def test_lora(tmp_path):
    results = quick_results("lora", tmp_path)
    full, lora = results["runs"]["full"], results["runs"]["lora"]
    assert full["parameters"] == full["trainable"] < lora["parameters"]
    # AdamW's two fp32 moments (and a step count) per trainable tensor, for the adapters only.
    ratio = results["lora_vs_full"]
    assert ratio["optimizer_state"] == pytest.approx(ratio["trainable"], rel=1e-3)
    assert lora["step_peak_bytes"] < full["step_peak_bytes"]
    assert ratio["step_time"]["ratio"]["n"] == 3


def test_moe(tmp_path):
    results = quick_results("moe", tmp_path)
    versus = results["moe_vs_dense"]
    # Equal active parameters but the router's gate (and Qwen3's head norms).
    assert 0 < versus["moe_active_params"] - versus["dense_params"] < 0.01 * versus["dense_params"]
    assert versus["moe_total_params"] > 1.5 * versus["moe_active_params"]
    assert versus["moe_tokens_per_s_vs_dense"]["ratio"]["n"] == 2
    assert [g["dtype"] for g in results["grouped_vs_loop"]] == ["float32", "bfloat16"]
    assert all(g["bitwise_equal"] for g in results["grouped_vs_loop"])


def test_pipeline(tmp_path):
    results = quick_results("pipeline", tmp_path, "--microbatches", "4")
    assert [(r["schedule"], r["microbatches"]) for r in results] == [
        ("1F1B", 4), ("ZBVZeroBubble", 4),
    ]  # fmt: skip
    assert [r["bubble_theory"] for r in results] == [0.2, 0.0]
    for r in results:
        assert [rank["rank"] for rank in r["ranks"]] == [0, 1]
        for rank in r["ranks"]:
            assert 0 < rank["busy_s"]["median"] <= rank["step_s"]["median"]
            assert rank["bubble"]["n"] == 2
        assert r["pp2_over_one_process"]["ratio"]["n"] == 2


def test_context_parallel(tmp_path):
    results = quick_results("context_parallel", tmp_path)
    ratio = {(m["cp"], m["method"], m["seq_len"]): m["ratio_to_cp1"] for m in results["memory"]}
    methods = ("allgather", "ulysses")
    assert list(ratio) == [(1, None, 256), (1, None, 512)] + [
        (cp, method, seq_len) for cp in (2, 4) for method in methods for seq_len in (256, 512)
    ]
    assert all(len(m["bytes_per_rank"]) == m["cp"] for m in results["memory"])
    for method in methods:
        for seq_len in (256, 512):
            # Each rank keeps less at cp 4 than at cp 2, and more than 1 / cp of cp 1's.
            assert 1 > ratio[2, method, seq_len] > ratio[4, method, seq_len] > 1 / 4
            assert ratio[2, method, seq_len] > 1 / 2
    timing = results["timing"]
    assert [(t["processes"], t["method"]) for t in timing] == [
        (1, None), (2, "allgather"), (2, "ulysses"), (4, "allgather"), (4, "ulysses"),
    ]  # fmt: skip
    assert all(t["step_seconds"]["n"] == t["step_cpu_seconds"]["n"] == 2 for t in timing)
