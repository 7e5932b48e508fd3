"""The benchmarks in bench/ run (--quick) and write the JSON fields docs/benchmarks.md documents.

No timing is asserted: these machines are shared. What is asserted is what must hold on any
machine: the hand-written loop does the same work as plugtrain (equal losses), the inactive
scaler leaves the profile unchanged while the active one does not, FSDP2 splits the shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RECORD_FIELDS = {"benchmark", "command", "args", "machine", "time", "results"}
MACHINE_FIELDS = {"cpu", "cpu_count", "torch_threads", "load_average", "python", "torch"}
SUMMARY_FIELDS = {"median", "q1", "q3", "min", "max", "n"}


def run_bench(repo: Path, name: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(repo / "bench" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def quick_results(repo: Path, name: str, tmp_path: Path, *args: str) -> dict:
    """Run ``bench/<name>.py --quick`` and return the ``results`` of the JSON it wrote."""
    out = tmp_path / f"{name}.json"
    result = run_bench(repo, name, tmp_path, "--quick", "--out", str(out), *args)
    assert result.returncode == 0, result.stderr
    assert "| " in result.stdout  # the printed table
    record = json.loads(out.read_text())
    assert set(record) == RECORD_FIELDS
    assert record["benchmark"] == name
    assert record["args"]["quick"] is True
    assert set(record["machine"]) >= MACHINE_FIELDS
    return record["results"]


@pytest.mark.slow
def test_hook_overhead(repo, tmp_path):
    results = quick_results(repo, "hook_overhead", tmp_path)
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
    (same,) = quick_results(repo, "hook_overhead", tmp_path, *args)["cases"]
    assert same["same_model"] is True and same["losses_bitwise_equal"] is None
    assert same["cpu"]["ratio"]["n"] == 3


def assert_summary(summary: dict) -> None:
    assert set(summary) == SUMMARY_FIELDS
    assert 0 < summary["min"] <= summary["q1"] <= summary["median"] <= summary["q3"]
    assert summary["q3"] <= summary["max"]


def assert_difference(diff: dict, a: dict, b: dict) -> None:
    for key in ("min", "median"):
        assert diff[key] == pytest.approx(a[key] - b[key], rel=1e-9, abs=1e-9), key


@pytest.mark.slow
def test_dispatch(repo, tmp_path):
    results = quick_results(repo, "dispatch", tmp_path)
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


@pytest.mark.slow
def test_inactive_scaler(repo, tmp_path):
    results = quick_results(repo, "inactive_scaler", tmp_path)
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


@pytest.mark.slow
def test_scaling(repo, tmp_path):
    results = quick_results(repo, "scaling", tmp_path)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_gpu_bench_fails_fast_without_cuda(repo, tmp_path):
    result = run_bench(repo, "gpu", tmp_path, "--out", str(tmp_path / "gpu.json"))
    assert result.returncode == 2
    assert "bench/gpu.py: error: no CUDA device available" in result.stderr
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow
def test_data_scale(repo, tmp_path):
    results = quick_results(repo, "data_scale", tmp_path)
    (corpus,) = results["corpora"]
    assert corpus["size_mb"] == 0.25 and corpus["tokens"] > 50_000
    for workers in ("1", "2"):
        prepared = corpus["prepare"][workers]
        assert prepared["mb_per_s"] > 0 and prepared["ratio_per_worker"] > 0
    for run in (corpus["train"], results["store"]["train"]):
        assert run["seconds"] > 0 and run["peak_rss_mb"] > 100
    assert results["store"]["tokens"] == 4_000_000
    assert 0 < results["data_share"] < 1


@pytest.mark.slow
def test_transforms(repo, tmp_path):
    results = quick_results(repo, "transforms", tmp_path)
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


@pytest.mark.slow
def test_export(repo, tmp_path):
    (tiny,) = quick_results(repo, "export", tmp_path)
    assert tiny["flavor"] == "tiny" and tiny["parameters"] > 100_000
    assert 0 < tiny["largest_tensor_mib"] < tiny["model_mib"]
    for mode in ("stream", "hold"):
        assert tiny[mode]["seconds"] > 0 and tiny[mode]["peak_rss_mib"] > 100


@pytest.mark.slow
def test_generate(repo, tmp_path):
    results = quick_results(repo, "generate", tmp_path)
    assert results["same_tokens"] is True
    flops = results["flops"]
    # The KV cache's arithmetic is one forward's: every new token's matmuls once.
    assert flops["cached"] == pytest.approx(flops["one_forward"], rel=0.05)
    assert flops["uncached"] > 5 * flops["cached"]


@pytest.fixture
def gpu_check(repo, tmp_path, monkeypatch):
    """``gpu_check(*args)``: run ``bench/gpu_check.py``'s main process in this one (its tests and
    worker are subprocesses): its exit status and JSON record (``{}`` if none was written)."""
    monkeypatch.syspath_prepend(str(repo / "bench"))
    monkeypatch.delenv("PLUGTRAIN_GPU_TESTS_ON_CPU", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import gpu_check as module

    threads = torch.get_num_threads()  # --threads sets this process's

    def run(*args: str) -> tuple[int, dict]:
        out = tmp_path / "gpu_check.json"
        out.unlink(missing_ok=True)
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(out), *args])
        with pytest.raises(SystemExit) as done:
            module.main()
        return done.value.code, json.loads(out.read_text()) if out.is_file() else {}

    run.module = module
    yield run
    torch.set_num_threads(threads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_gpu_check_fails_fast_without_cuda(gpu_check, capsys):
    assert gpu_check() == (2, {})
    err = capsys.readouterr().err
    assert err.startswith("bench/gpu_check.py: error: no CUDA device available")
    assert err.count("\n") == 1


def test_gpu_check_past_its_budget_starts_nothing_and_says_so(gpu_check):
    code, record = gpu_check("--dry-run", "--budget-s", "0")
    assert code == 0
    statuses = {p: r["status"] for p, r in record["results"]["parts"].items()}
    assert list(statuses) == record["args"]["parts"].split(",")
    assert set(statuses.values()) == {"skipped"}


@pytest.mark.slow
def test_gpu_check_dry_run(gpu_check, tmp_path):
    parts = "tests,tp-fp16,oh-1B-bf16"
    code, record = gpu_check("--dry-run", "--parts", parts)
    assert code == 0
    assert set(record) == RECORD_FIELDS and record["args"]["dry_run"] is True
    results = record["results"]
    assert list(results["parts"]) == parts.split(",")
    tests, throughput, overhead = results["parts"].values()
    assert {p["status"] for p in results["parts"].values()} == {"ok"}
    # Without CUDA every GPU test is collected and skipped.
    assert tests["counts"]["passed"] == tests["counts"]["failed"] == 0
    assert tests["counts"]["skipped"] == len(tests["outcomes"]) >= 10
    assert any("test_sync_free" in name for name in tests["outcomes"])
    assert throughput["result"]["dtype"] == "float16" and throughput["result"]["tokens_per_s"] > 0
    assert sorted(throughput["result"]["active_plugins"]) == ["grad_clip", "grad_scaler"]
    assert overhead["result"]["losses_bitwise_equal"] is True
    verdicts = results["verdicts"]
    assert list(verdicts) == [
        "bf16_mfu", "fp16_over_bf16_tokens_per_s", "hook_overhead_1B_bf16", "sync_free_steps",
    ]  # fmt: skip
    assert verdicts["bf16_mfu"]["met"] is None  # bf16 throughput was not measured
    assert verdicts["hook_overhead_1B_bf16"]["value"] > 0
    assert verdicts["sync_free_steps"]["met"] is None  # skipped tests are no verdict
    summary = (tmp_path / "gpu_check.md").read_text()
    assert summary == results["summary_markdown"] + "\n"
    assert "| tp-fp16 " in summary and "| hook_overhead_1B_bf16 " in summary


def test_gpu_check_verdicts_read_the_test_outcomes(gpu_check, tmp_path):
    module = gpu_check.module
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_sync_free" name="test_a"/>'
        '<testcase classname="tests.gpu.test_sync_free" name="test_b"><failure message="x"/>'
        "</testcase>"
        '<testcase classname="tests.gpu.test_prefetch" name="test_c"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    outcomes = module.junit_outcomes(junit)
    assert outcomes == {
        "tests.gpu.test_sync_free::test_a": "passed",
        "tests.gpu.test_sync_free::test_b": "failed",
        "tests.gpu.test_prefetch::test_c": "skipped",
    }
    parts = {
        "tests": {"status": "failed", "seconds": 1.0, "outcomes": outcomes},
        "tp-bf16": {"status": "ok", "seconds": 1.0, "result": {"mfu": 0.5, "tokens_per_s": 100.0}},
        "tp-fp16": {"status": "ok", "seconds": 1.0, "result": {"mfu": 0.5, "tokens_per_s": 96.0}},
    }
    verdicts = module.verdicts(parts)
    assert verdicts["sync_free_steps"] == {
        "target": "no sync raised", "value": "1/2 passed", "met": False,
    }  # fmt: skip
    assert verdicts["bf16_mfu"]["met"] is True
    assert verdicts["fp16_over_bf16_tokens_per_s"]["met"] is False  # 0.96 < 0.97
    assert verdicts["hook_overhead_1B_bf16"] == {"target": "<= 1.01", "value": None, "met": None}
