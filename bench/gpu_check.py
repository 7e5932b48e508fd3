"""The GPU acceptance run, one command: the GPU tests, then the GPU benchmarks, within a budget.

    python bench/gpu_check.py --budget-s 480

Parts, most valuable first, so that what matters most is done when the budget runs out:

1. ``tests``: ``pytest -m gpu`` (tests/gpu) in a subprocess: each test's outcome; the
   sync-debug verdict is that of ``tests/gpu/test_sync_free.py``.
2. Throughput of the 1B shape (``bench/gpu.py``'s ``throughput``: ``Trainer.train_step`` with
   grad_clip and grad_scaler): bf16 (MFU target >= 45%), fp16 with the scaler (within 3% of
   bf16's tokens/s), then compiled, with activation checkpointing, both.
3. Hook overhead against the hand-written loop (``bench/hook_overhead.py``'s ``run_case``):
   1B in bf16 (target <= 1%) and fp16 (2%), the debug model (host-bound) last.
4. The roofline row (``bench/roofline.py``'s on a GPU): the 1B bf16 step against the GPU's
   peak (MFU) and against its matmul limit, torch's own matmuls timed at the step's GEMM
   shapes (``ModelArgs.gemms``, the FLOP formula of both).
5. Memory of fine-tuning a Llama 3 8B-shaped model (``bench/lora.py``'s ``gpu_memory``: bf16,
   full activation checkpointing, 1 x 2048 tokens): full fine-tuning, LoRA (rank 8, all seven
   projections) and QLoRA (the same, the base in NF4) with 8 of its 32 blocks, where full
   fine-tuning fits one 80 GB GPU, then LoRA and QLoRA with all 32: the peak while building,
   the steps' peak, the weights and AdamW's state held, the memory estimate, tokens/s. The
   verdict checks that the NF4 base really holds about half a byte a value.
6. The moe family's routed experts at a Qwen3-30B-A3B layer's shape (``bench/moe.py``'s
   ``grouped_vs_loop``: 128 experts, 4096 tokens routed top-8, dim 2048, expert hidden 768,
   bf16): ``F.grouped_mm`` against the loop over experts, forward and backward, taking turns,
   and whether the two are bitwise equal on the GPU.

The benchmark parts run one after another in a worker process, which a crash or an overrun
ends (the next part starts a new one). The JSON report (``--out``) and its Markdown summary
(same name, ``.md``: tables ready for docs/benchmarks/gpu.md) are rewritten after every part, so a
run killed from outside keeps what finished. No part starts after ``--budget-s`` seconds; one
still running at ``--budget-s`` + ``--grace-s`` (default 480 + 90) is killed, so the whole run
ends within a 600 s limit. Exit status: 0 if every test passed and every part that ran
finished, 1 otherwise, 2 without CUDA (one line).

``--dry-run`` checks the script on a CPU in seconds: the tiny model, a few steps, CUDA's
memory and synchronisation calls replaced by stand-ins, the GPU tests skipped (CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
from gpu import FP16_TARGET, MFU_TARGET

NAME = "gpu_check"
REPO = benchlib.REPO
SYNC_TESTS = "test_sync_free"
"""The module of tests/gpu whose outcome is the sync-debug verdict."""


@dataclass(frozen=True)
class Part:
    """One benchmark part: a throughput measurement or a hook-overhead comparison."""

    id: str
    kind: str
    """``throughput``, ``overhead``, ``roofline`` (a throughput with the matmul limit),
    ``memory`` (a fine-tuning mode's memory) or ``moe`` (grouped GEMM against the loop)."""
    dtype: str
    flavor: str = "1B"
    compile: bool = False
    ac: str | None = None
    lora: str | None = None
    """``memory`` parts: ``full``, ``lora`` or ``qlora`` (``bench/lora.py``'s ``MODES``)."""
    layers: int | None = None
    """``memory`` parts: the blocks of the flavor's shape (None: all)."""


PARTS = [
    Part("tp-bf16", "throughput", "bfloat16"),
    Part("tp-fp16", "throughput", "float16"),
    Part("oh-1B-bf16", "overhead", "bfloat16"),
    Part("tp-bf16-compile", "throughput", "bfloat16", compile=True),
    Part("tp-bf16-ac", "throughput", "bfloat16", ac="full"),
    Part("tp-bf16-compile-ac", "throughput", "bfloat16", compile=True, ac="full"),
    Part("tp-fp16-compile", "throughput", "float16", compile=True),
    Part("oh-1B-fp16", "overhead", "float16"),
    Part("oh-debug-bf16", "overhead", "bfloat16", flavor="debug"),
    Part("oh-debug-fp16", "overhead", "float16", flavor="debug"),
    Part("roofline-1B-bf16", "roofline", "bfloat16"),
    Part("mem-8B-full", "memory", "bfloat16", flavor="8B", lora="full", layers=8),
    Part("mem-8B-lora", "memory", "bfloat16", flavor="8B", lora="lora", layers=8),
    Part("mem-8B-qlora", "memory", "bfloat16", flavor="8B", lora="qlora", layers=8),
    Part("mem-8B32-lora", "memory", "bfloat16", flavor="8B", lora="lora"),
    Part("mem-8B32-qlora", "memory", "bfloat16", flavor="8B", lora="qlora"),
    Part("moe-30B-A3B-bf16", "moe", "bfloat16", flavor="qwen3_30b_a3b"),
]
"""The benchmark parts, in the order they run (after the tests)."""
ALL_PARTS = ["tests", *(p.id for p in PARTS)]
OVERHEAD_TARGET = {"bfloat16": 1.01, "float16": 1.02}
NF4_BYTES_TARGET = 0.53
"""An NF4 base holds at most this many bytes a value (half a byte, its scales): more means
FSDP2 or the load kept a float copy, the memory QLoRA exists to save."""
DRY_SHAPE = ["--model.flavor", "debug", "--model.ffn_dim", "512"]
"""The dry run's model for the memory parts: the smallest whose weights NF4 can hold."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget-s", type=float, default=480, help="start no part after this many seconds"
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=90,
        help="kill a part still running this long after the budget (default: %(default)s)",
    )
    parser.add_argument(
        "--part-timeout-s", type=float, default=150, help="kill a benchmark part after this long"
    )
    parser.add_argument(
        "--tests-timeout-s", type=float, default=240, help="kill the GPU tests after this long"
    )
    parser.add_argument(
        "--parts",
        default=",".join(ALL_PARTS),
        help="comma-separated, in this order, of: %(default)s",
    )
    parser.add_argument(
        "--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: by its name)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="on the CPU, tiny shapes: checks that it runs"
    )
    # The worker: runs benchmark parts, one JSON line each (started by the main process).
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- the worker


def replace_cuda_calls() -> None:
    """The dry run's stand-ins for the CUDA calls the benchmarks make (none, or 0 bytes)."""
    import torch

    for name, value in (
        ("synchronize", None),
        ("reset_peak_memory_stats", None),
        ("empty_cache", None),
        ("max_memory_allocated", 0),
        ("memory_allocated", 0),
    ):
        setattr(torch.cuda, name, lambda *args, _value=value, **kwargs: _value)


def run_part(part: Part, args: argparse.Namespace, peak: float | None) -> dict:
    """Measure one part in this process (the worker)."""
    import torch
    from gpu import throughput
    from hook_overhead import Case, run_case
    from lora import gpu_memory, shape_args

    dry = args.dry_run
    flavor = "tiny" if dry else part.flavor
    if part.kind == "moe":
        from moe import CPU_LAYER, QWEN3_30B_A3B_LAYER, grouped_vs_loop

        layer = CPU_LAYER if dry else QWEN3_30B_A3B_LAYER
        dtype = getattr(torch, part.dtype)
        return grouped_vs_loop(2 if dry else 10, dtype, layer, "cpu" if dry else "cuda")
    if part.kind == "memory":
        assert part.lora is not None
        shape = DRY_SHAPE if dry else shape_args(part.flavor, part.layers)
        batch, seq = (2, 32) if dry else (1, 2048)
        warmup, steps = (1, 2) if dry else (2, 5)
        return gpu_memory(part.lora, shape, part.dtype, batch, seq, warmup, steps)
    if part.kind in ("throughput", "roofline"):
        batch, seq = (2, 32) if dry else (4, 2048)
        # NOTE: inductor on a CPU needs a C++ compiler and minutes; aot_eager runs the same
        # plugin path without it.
        extra = ["--compile.backend", "aot_eager"] if dry and part.compile else []
        warmup, steps = (1, 2) if dry else (5, 20)
        result = throughput(
            flavor, part.dtype, batch, seq, warmup, steps, part.compile, peak, part.ac, extra
        )
        if part.kind == "roofline":
            step_s = result["step_seconds"]["median"]
            result |= matmul_limit(flavor, part.dtype, batch, seq, step_s)
    else:
        batch, seq = (2, 32) if dry else ((8, 128) if part.flavor == "debug" else (2, 2048))
        n_rounds = 2 if dry else (60 if part.flavor == "debug" else 10)
        case = Case(part.id, flavor, part.dtype, batch, seq, n_rounds, OVERHEAD_TARGET[part.dtype])
        memory_gib = 0.0 if dry else torch.cuda.get_device_properties(0).total_memory / 2**30
        # NOTE: the control is a third model and optimizer: 1B needs ~25 GB for each.
        control = part.flavor == "debug" or memory_gib >= 120 or dry
        result = run_case(case, n_rounds, 1 if dry else 5, accum=1, control=control)
    return result


def matmul_limit(flavor: str, dtype: str, batch: int, seq: int, step_seconds: float) -> dict:
    """The step's GEMMs timed alone with torch's matmuls on the GPU, and the step's fraction."""
    import torch

    from plugtrain.model import DTYPES, FLAVORS
    from plugtrain.observability.limits import matmul_seconds

    gemms = FLAVORS[flavor].gemms(batch, seq)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seconds = matmul_seconds(gemms, device, DTYPES[dtype])
    return {
        "matmul_limit_seconds": seconds,
        "matmul_limit_tflops": sum(g.flops for g in gemms) / seconds / 1e12,
        "fraction_of_matmul_limit": seconds / step_seconds,
    }


def worker(args: argparse.Namespace) -> None:
    """Run the parts named in ``--parts`` in turn, appending a JSON line to ``--worker`` as each
    starts and ends; start none after ``--deadline`` (a ``time.time()``)."""
    import torch
    from gpu import free_cuda

    from plugtrain.observability import limits

    if args.dry_run:
        replace_cuda_calls()
        peak = (args.peak_tflops or 1.0) * 1e12  # a stand-in, so that MFU is computed
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        tflops = limits.peak_tflops(
            torch.device("cuda", 0), torch.bfloat16, args.peak_tflops or 0.0
        )
        peak = tflops * 1e12 if tflops else None
    by_id = {p.id: p for p in PARTS}
    with args.worker.open("a") as lines:

        def say(**record: Any) -> None:
            lines.write(json.dumps(record) + "\n")
            lines.flush()

        for part_id in args.parts.split(","):
            if time.time() >= args.deadline:
                return
            say(part=part_id, event="start", time=time.time())
            try:
                say(part=part_id, event="done", result=run_part(by_id[part_id], args, peak))
            except Exception as e:  # an out-of-memory, a compile failure: the next part runs
                say(part=part_id, event="error", error=f"{type(e).__name__}: {e}".splitlines()[0])
            torch._dynamo.reset()
            free_cuda()


# --------------------------------------------------------------------------- the main process


class Report:
    """The report: each part's status and result, the verdicts; written after every part."""

    def __init__(self, args: argparse.Namespace, start: float) -> None:
        self.args, self.start = args, start
        self.parts: dict[str, dict[str, Any]] = {}
        self.results: dict[str, Any] = {"dry_run": args.dry_run, "parts": self.parts}

    def record(self, part: str, status: str, seconds: float, **fields: Any) -> None:
        self.parts[part] = {"status": status, "seconds": round(seconds, 1), **fields}
        self.write()

    def write(self) -> None:
        self.results["verdicts"] = verdicts(self.parts)
        self.results["seconds"] = round(time.perf_counter() - self.start, 1)
        summary = summary_markdown(self.parts, self.results["verdicts"])
        self.results["summary_markdown"] = summary
        out = self.args.out
        partial = out.with_suffix(".partial")
        # NOTE: write_json prints where it wrote, which is said once, at the end.
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            benchlib.write_json(partial, NAME, self.args, self.results)
        os.replace(partial, out)  # a kill mid-write leaves the previous report whole
        partial.write_text(summary + "\n")
        os.replace(partial, out.with_suffix(".md"))


def run_tests(args: argparse.Namespace, report: Report, timeout: float) -> None:
    """``pytest -m gpu`` in a subprocess; each test's outcome from its JUnit XML."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable, "-m", "pytest", "-m", "gpu", str(REPO / "tests" / "gpu"),
            "-q", "-p", "no:cacheprovider", "-n", "0", f"--junitxml={junit}",
        ]  # fmt: skip  # one process: the tests measure the device's memory and syncs
        print(f"tests: {' '.join(command[2:])} ...", flush=True)
        try:
            done = subprocess.run(
                command, cwd=REPO, timeout=timeout, capture_output=True, text=True
            )
        except subprocess.TimeoutExpired:
            report.record("tests", "timeout", time.perf_counter() - start, limit_s=timeout)
            return
        print(done.stdout[-2000:], flush=True)
        if not junit.is_file():
            tail = (done.stdout + done.stderr)[-1000:]
            seconds = time.perf_counter() - start
            report.record("tests", "error", seconds, returncode=done.returncode, error=tail)
            return
        outcomes = junit_outcomes(junit)
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    status = "ok" if counts["failed"] == 0 else "failed"
    report.record(
        "tests", status, time.perf_counter() - start, returncode=done.returncode,
        counts=counts, outcomes=outcomes,
    )  # fmt: skip


def junit_outcomes(path: Path) -> dict[str, str]:
    """Each test case's outcome (passed, failed, skipped) in a JUnit XML file, by name."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        failed = tags & {"failure", "error"}
        outcomes[name] = "failed" if failed else ("skipped" if "skipped" in tags else "passed")
    return outcomes


def run_bench_parts(args: argparse.Namespace, report: Report, ids: list[str]) -> None:
    """The benchmark parts in worker processes: a new one after a crash or a killed part."""
    deadline = report.start + args.budget_s  # perf_counter time
    hard = deadline + args.grace_s
    pending = list(ids)
    log = args.out.with_suffix(".worker.log")
    while pending:
        if time.perf_counter() >= deadline:
            break
        lines_path = args.out.with_suffix(".lines.jsonl")
        lines_path.write_text("")
        command = [
            sys.executable, str(Path(__file__).resolve()), "--worker", str(lines_path),
            "--deadline", str(time.time() + deadline - time.perf_counter()),
            "--parts", ",".join(pending), "--out", str(args.out),
            "--threads", str(args.threads),
            *(["--dry-run"] if args.dry_run else []),
            *(["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []),
        ]  # fmt: skip
        with log.open("a") as stderr:
            worker_process = subprocess.Popen(command, cwd=REPO, stderr=stderr)
        current, started, seen, killed = None, 0.0, 0, False
        try:
            while True:
                exited = worker_process.poll() is not None
                text = lines_path.read_text()
                records = text[: text.rfind("\n") + 1].splitlines()  # whole lines only
                for line in records[seen:]:
                    record = json.loads(line)
                    part = record["part"]
                    if record["event"] == "start":
                        current, started = part, time.perf_counter()
                        print(f"{part} ...", flush=True)
                        continue
                    seconds = time.perf_counter() - started
                    if record["event"] == "done":
                        report.record(part, "ok", seconds, result=record["result"])
                    else:
                        report.record(part, "error", seconds, error=record["error"])
                    print(f"{part}: {report.parts[part]['status']} in {seconds:.0f} s", flush=True)
                    pending.remove(part)
                    current = None
                seen = len(records)
                if exited:
                    break
                now = time.perf_counter()
                overrun = current is not None and now - started > args.part_timeout_s
                if overrun or now > hard:  # past the hard limit, even while starting
                    worker_process.kill()
                    worker_process.wait()
                    killed = True
                    if current is not None:
                        limit = min(args.part_timeout_s, hard - started)
                        report.record(current, "timeout", now - started, limit_s=round(limit))
                        print(f"{current}: killed after {now - started:.0f} s", flush=True)
                        pending.remove(current)
                        current = None
                    break
                time.sleep(0.2)
        finally:
            if worker_process.poll() is None:
                worker_process.kill()
                worker_process.wait()
            lines_path.unlink(missing_ok=True)
        if current is not None:  # the worker died in a part
            tail = log.read_text()[-1000:] if log.is_file() else ""
            seconds = time.perf_counter() - started
            report.record(
                current, "error", seconds, error=f"worker exited {worker_process.returncode}",
                log_tail=tail,
            )  # fmt: skip
            pending.remove(current)
        elif time.perf_counter() >= deadline:
            break
        elif worker_process.returncode != 0 and pending and not killed:
            error = f"the worker exited {worker_process.returncode} before the part"
            report.record(pending.pop(0), "error", 0.0, error=error)
    for part in pending:
        report.record(part, "skipped", 0.0, reason=f"past --budget-s {args.budget_s:g}")


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    chosen = args.parts.split(",")
    unknown = [p for p in chosen if p not in ALL_PARTS]
    if unknown:
        print(
            f"bench/gpu_check.py: error: unknown part(s) {', '.join(unknown)}: "
            f"choose from {', '.join(ALL_PARTS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.worker is not None:
        worker(args)
        return
    if not args.dry_run:
        from gpu import require_cuda

        require_cuda("bench/gpu_check.py")
    start = time.perf_counter()
    report = Report(args, start)
    report.write()  # from the start: a run killed in its first part still leaves a report

    def terminated(*_: Any) -> None:
        # A SIGTERM (a timeout from outside) ends the run: the parts done are on disk, the
        # one in flight is named, and the worker is killed on the way out.
        report.results["terminated_during"] = [p for p in chosen if p not in report.parts][:1]
        sys.exit(143)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        if "tests" in chosen:
            if args.budget_s > 0:
                run_tests(args, report, min(args.tests_timeout_s, args.budget_s + args.grace_s))
            else:
                reason = f"past --budget-s {args.budget_s:g}"
                report.record("tests", "skipped", 0.0, reason=reason)
        run_bench_parts(args, report, [p for p in chosen if p != "tests"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        report.write()
    print("\n" + report.results["summary_markdown"])
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    failed = [p for p, r in report.parts.items() if r["status"] not in ("ok", "skipped")]
    raise SystemExit(1 if failed else 0)


# --------------------------------------------------------------------------- verdicts


def verdicts(parts: dict[str, dict]) -> dict[str, dict]:
    """Each target: what was measured, and whether it is met (None: not measured)."""
    result = {p: r.get("result") for p, r in parts.items() if r["status"] == "ok"}
    bf16, fp16, overhead = result.get("tp-bf16"), result.get("tp-fp16"), result.get("oh-1B-bf16")
    mfu = bf16["mfu"] if bf16 else None
    ratio = fp16["tokens_per_s"] / bf16["tokens_per_s"] if bf16 and fp16 else None
    hooks = overhead["wall"]["ratio"]["median"] if overhead else None
    nf4 = [r["nf4_bytes_per_value"] for p, r in result.items() if p.startswith("mem-") and r]
    nf4_bytes = max((b for b in nf4 if b is not None), default=None)
    tests = parts.get("tests", {}).get("outcomes", {})
    sync = [v for k, v in tests.items() if SYNC_TESTS in k and v != "skipped"]
    return {
        "bf16_mfu": check(">= 0.45", mfu, mfu is not None and mfu >= MFU_TARGET),
        "fp16_over_bf16_tokens_per_s": check(
            ">= 0.97", ratio, ratio is not None and ratio >= FP16_TARGET
        ),
        "hook_overhead_1B_bf16": check("<= 1.01", hooks, hooks is not None and hooks <= 1.01),
        "sync_free_steps": check(
            "no sync raised",
            f"{sync.count('passed')}/{len(sync)} passed" if sync else None,
            all(v == "passed" for v in sync),
        ),
        "qlora_nf4_bytes_per_value": check(
            f"<= {NF4_BYTES_TARGET}",
            nf4_bytes,
            nf4_bytes is not None and nf4_bytes <= NF4_BYTES_TARGET,
        ),
    }


def check(target: str, value: Any, met: bool) -> dict[str, Any]:
    """A verdict: ``met`` is None when nothing was measured."""
    return {"target": target, "value": value, "met": None if value is None else met}


def summary_markdown(parts: dict[str, dict], checks: dict[str, dict]) -> str:
    """The targets and the parts as Markdown tables."""

    def shown(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    rows = [
        [name, c["target"], shown(c["value"]), {True: "yes", False: "NO", None: "?"}[c["met"]]]
        for name, c in checks.items()
    ]
    text = benchlib.table(["check", "target", "measured", "met"], rows)
    rows = []
    for part, r in parts.items():
        res = r.get("result") or {}
        cells = ["", "", "", ""]
        if "tokens_per_s" in res:
            mfu = res["mfu"]
            cells = [
                f"{res['tokens_per_s']:,.0f}", "-" if mfu is None else f"{mfu:.1%}",
                f"{res['peak_memory_gib']:.1f}", "",
            ]  # fmt: skip
        elif "wall" in res:
            ratio = res["wall"]["ratio"]
            cells[3] = f"{ratio['median']:.4f} [{ratio['q1']:.3f}-{ratio['q3']:.3f}]"
        elif "grouped_vs_loop_time" in res:
            ratio = res["grouped_vs_loop_time"]["ratio"]
            cells[3] = f"grouped/loop {ratio['median']:.3f}"
        elif "counts" in r:
            cells[3] = ", ".join(f"{n} {k}" for k, n in r["counts"].items())
        detail = r.get("error") or r.get("reason") or ""
        if "estimate_gib" in res:
            detail = (
                f"{res['mode']}: weights {res['weight_bytes'] / 2**30:.1f} GiB, AdamW "
                f"{res['optimizer_state_bytes'] / 2**30:.2f} GiB, build peak "
                f"{res['build_peak_gib']:.1f} GiB, estimate {res['estimate_gib']:.1f} GiB"
            )
        if "bitwise_equal" in res:
            detail = f"grouped GEMM bitwise equal to the loop: {res['bitwise_equal']}"
        if "fraction_of_matmul_limit" in res:
            detail = f"{res['fraction_of_matmul_limit']:.1%} of the matmul limit"
        rows.append([part, r["status"], f"{r['seconds']:.0f}", *cells, detail])
    headers = ["part", "status", "s", "tokens/s", "MFU", "peak GiB", "A/B or tests", "note"]
    return text + "\n\n" + benchlib.table(headers, rows)


if __name__ == "__main__":
    main()
