"""The GPU benchmarks' checks that run without a GPU: the refusals, the budget, the verdicts.

The CPU benchmarks' end-to-end runs (``--quick``) are in ``bench/test_quick.py``, outside the
suite: ``python -m pytest bench``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from plugtrain.testing import run_script

RECORD_FIELDS = {"benchmark", "command", "args", "machine", "time", "results"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_gpu_bench_fails_fast_without_cuda(repo, tmp_path):
    args = ["--out", str(tmp_path / "gpu.json")]
    result = run_script(repo / "bench" / "gpu.py", args, cwd=tmp_path)
    assert result.returncode == 2
    assert "bench/gpu.py: error: no CUDA device available" in result.stderr
    assert not (tmp_path / "gpu.json").exists()


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
    parts = "tests,tp-fp16,oh-1B-bf16,roofline-1B-bf16,mem-8B-qlora"
    code, record = gpu_check("--dry-run", "--parts", parts)
    assert code == 0
    assert set(record) == RECORD_FIELDS and record["args"]["dry_run"] is True
    results = record["results"]
    assert list(results["parts"]) == parts.split(",")
    tests, throughput, overhead, roofline, qlora = results["parts"].values()
    assert {p["status"] for p in results["parts"].values()} == {"ok"}
    # Without CUDA every GPU test is collected and skipped.
    assert tests["counts"]["passed"] == tests["counts"]["failed"] == 0
    assert tests["counts"]["skipped"] == len(tests["outcomes"]) >= 10
    assert any("test_sync_free" in name for name in tests["outcomes"])
    assert throughput["result"]["dtype"] == "float16" and throughput["result"]["tokens_per_s"] > 0
    assert sorted(throughput["result"]["active_plugins"]) == ["grad_clip", "grad_scaler"]
    assert overhead["result"]["losses_bitwise_equal"] is True
    # The roofline row: the step against its peak (MFU) and its GEMMs timed alone.
    row = roofline["result"]
    assert row["dtype"] == "bfloat16" and row["mfu"] > 0
    assert row["fraction_of_matmul_limit"] == pytest.approx(
        row["matmul_limit_seconds"] / row["step_seconds"]["median"]
    )
    # QLoRA's memory part: the dry run's model, its base held in NF4 (the adapters only train).
    memory = qlora["result"]
    assert memory["mode"] == "qlora" and memory["trainable"] < 0.1 * memory["parameters"]
    # AdamW's two fp32 moments per trainable value (and a step count per tensor).
    assert memory["optimizer_state_bytes"] == pytest.approx(8 * memory["trainable"], rel=1e-3)
    verdicts = results["verdicts"]
    assert list(verdicts) == [
        "bf16_mfu", "fp16_over_bf16_tokens_per_s", "hook_overhead_1B_bf16", "sync_free_steps",
        "qlora_nf4_bytes_per_value",
    ]  # fmt: skip
    assert verdicts["qlora_nf4_bytes_per_value"]["value"] == memory["nf4_bytes_per_value"]
    assert 0.5 < memory["nf4_bytes_per_value"] <= 0.53
    assert verdicts["qlora_nf4_bytes_per_value"]["met"] is True
    assert verdicts["bf16_mfu"]["met"] is None  # bf16 throughput was not measured
    assert verdicts["hook_overhead_1B_bf16"]["value"] > 0
    assert verdicts["sync_free_steps"]["met"] is None  # skipped tests are no verdict
    summary = (tmp_path / "gpu_check.md").read_text()
    assert summary == results["summary_markdown"] + "\n"
    assert "| tp-fp16 " in summary and "| hook_overhead_1B_bf16 " in summary
    assert "of the matmul limit" in summary and "qlora: weights " in summary


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


@pytest.mark.slow
def test_gpu_check_dry_run_times_the_moe_experts(gpu_check, tmp_path):
    code, record = gpu_check("--dry-run", "--parts", "moe-30B-A3B-bf16")
    assert code == 0
    part = record["results"]["parts"]["moe-30B-A3B-bf16"]
    assert part["status"] == "ok" and part["result"]["bitwise_equal"] is True
    assert part["result"]["dtype"] == "bfloat16"
    assert part["result"]["shape"]["experts"] == 8  # the dry run's small CPU layer
    assert "grouped/loop " in (tmp_path / "gpu_check.md").read_text()
