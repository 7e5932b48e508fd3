"""The GPU benchmarks, as one script for one CUDA GPU: hook overhead, tokens/s and MFU of ~1B.

1. Hook overhead on CUDA: ``bench/hook_overhead.py``'s comparison (plugtrain's step with
   ``grad_clip`` and ``grad_scaler`` against the hand-written loop, alternated, ratio A/B) for
   the debug model (small kernels: the host-bound case, where hooks weigh most) and the 1B
   model, each in bfloat16 and in float16 (scaler active). Targets: 1% in bf16, 2% in fp16.
2. Throughput of the "1B" flavour (Llama 3.2 1B shapes; the vocabulary is the sample
   tokenizer's) through ``Trainer.train_step`` with both plugins enabled: tokens/s, MFU (model
   FLOPs from ``ModelArgs.flops_per_token`` over the GPU's dense bf16/fp16 peak, from
   ``plugtrain.observability.limits.peak_tflops``, as a training run's ``mfu_pct``) and peak
   memory, in bfloat16 and in float16 with the scaler. Targets: MFU >= 45% in bf16 on an
   H100/H200-class GPU; fp16 with the scaler within 3% of bf16 tokens/s.

Everything runs in one process on ``cuda:0`` and finishes in well under 10 minutes on an H100
or H200 (``--budget-s`` stops starting new parts after that many seconds). On a machine
without CUDA it stops at once with exit status 2 and says so.

    python bench/gpu.py                   # add --compile, --ac full: the transform plugins
    python bench/gpu.py --quick           # a minute: few steps, checks that it all runs

``bench/gpu_check.py`` runs the GPU tests and these parts, one by one, as a GPU session's one
prepared command.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence

import benchlib
import torch

NAME = "gpu"
MFU_TARGET = 0.45
FP16_TARGET = 0.97
"""fp16 with the scaler must reach at least this fraction of bf16's tokens/s."""


def require_cuda(prog: str = "bench/gpu.py") -> None:
    """Exit at once, with a one-line reason, when there is no CUDA device to benchmark."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        print(
            f"{prog}: error: no CUDA device available (torch {torch.__version__} built "
            f"with {built}): run it on a machine with an NVIDIA GPU; the CPU benchmarks are "
            "bench/hook_overhead.py, dispatch.py, inactive_scaler.py and scaling.py",
            file=sys.stderr,
        )
        raise SystemExit(2)


def transform_args(compile_: bool, ac: str | None) -> list[str]:
    """Config arguments enabling the model transforms through their plugins: ``compile``
    (inductor, per block) and ``activation_checkpointing`` in ``ac`` mode."""
    plugins, extra = [], []
    if compile_:
        plugins.append("compile")
    if ac is not None:
        plugins.append("activation_checkpointing")
        if ac != "full":
            by = ac.removeprefix("selective-")
            extra += ["--activation_checkpointing.mode", "selective",
                      "--activation_checkpointing.selective_by", by]  # fmt: skip
    return ["--plugins.enabled", ",".join(plugins), *extra] if plugins else []


def throughput(
    flavor: str,
    dtype: str,
    batch_size: int,
    seq_len: int,
    warmup: int,
    steps: int,
    compile_: bool,
    peak: float | None,
    ac: str | None = None,
    extra: Sequence[str] = (),
) -> dict:
    """Tokens/s, MFU and peak memory of ``Trainer.train_step`` with both plugins enabled
    (``extra``: more config arguments, last)."""
    from hook_overhead import PLUGINS, timed

    from plugtrain.training.launch import configure
    from plugtrain.training.trainer import Trainer

    train_args = benchlib.trainer_args(
        flavor,
        dtype,
        "--plugins.enabled", ",".join(PLUGINS),
        "--training.steps", str(warmup + steps + 1),
        "--lr_scheduler.warmup_steps", "1",
        batch_size=batch_size,
        seq_len=seq_len,
    )  # fmt: skip
    transforms = transform_args(compile_, ac)
    if transforms:  # the last --plugins.enabled wins: name every plugin in it
        transforms[1] = ",".join([*PLUGINS, transforms[1]])
    trainer = Trainer(*configure([*train_args, *transforms, *extra]))
    step = trainer.train_step
    for _ in range(warmup):
        step(trainer.batches.next_batch())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    skipped_before = int(trainer.vetoes.total)
    seconds = []
    for _ in range(steps):
        batch = trainer.batches.next_batch()
        seconds.append(timed(lambda b: step(b)[0], batch)[0])
    step_s = benchlib.summary(seconds)
    tokens = batch_size * seq_len
    tokens_per_s = tokens / step_s["median"]
    flops_per_token = trainer.model_args.flops_per_token(seq_len)
    return {
        "flavor": flavor,
        "dtype": dtype,
        "compile": compile_,
        "activation_checkpointing": ac,
        "params": trainer.model_args.num_params(),
        "params_non_embedding": trainer.model_args.num_params(exclude_embedding=True),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "active_plugins": trainer.host.names(),
        "steps": steps,
        "skipped_steps": int(trainer.vetoes.total) - skipped_before,
        "step_seconds": step_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--flavor", default="1B", help="the large model's flavour (default: %(default)s)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each block (the compile plugin)"
    )
    parser.add_argument(
        "--ac",
        choices=["full", "selective-op", "selective-layer"],
        help="activation checkpointing (the activation_checkpointing plugin) in this mode",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="1B throughput batch")
    parser.add_argument("--seq-len", type=int, default=2048, help="1B throughput sequence length")
    parser.add_argument("--steps", type=int, default=20, help="timed 1B throughput steps")
    parser.add_argument(
        "--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: by its name)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=540, help="start no new part after this many seconds"
    )


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    require_cuda()
    from hook_overhead import Case, run_case

    from plugtrain.observability import limits

    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    gpu_name = torch.cuda.get_device_name(0)
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    # The core's table of dense bf16 peaks (what a run's mfu_pct uses), or --peak-tflops.
    peak_tflops = limits.peak_tflops(
        torch.device("cuda", 0), torch.bfloat16, args.peak_tflops or 0.0
    )
    peak = peak_tflops * 1e12 if peak_tflops else None
    print(f"{gpu_name}: dense bf16 peak {peak_tflops or '?'} TFLOP/s")
    steps = 3 if args.quick else args.steps
    cases = [
        Case("debug-bf16", "debug", "bfloat16", 8, 128, rounds=60, target=1.01),
        Case("debug-fp16", "debug", "float16", 8, 128, rounds=60, target=1.02),
        Case(f"{args.flavor}-bf16", args.flavor, "bfloat16", 2, 2048, rounds=10, target=1.01),
        Case(f"{args.flavor}-fp16", args.flavor, "float16", 2, 2048, rounds=10, target=1.02),
    ]
    overhead: list[dict] = []
    results: dict = {
        "gpu": gpu_name,
        "peak_flops": peak,
        "flavor": args.flavor,
        "overhead": overhead,
    }

    def within_budget(part: str) -> bool:
        if time.perf_counter() - start < args.budget_s:
            return True
        print(f"skipped {part}: past --budget-s {args.budget_s:g}")
        results.setdefault("skipped", []).append(part)
        return False

    for case in cases:
        if not within_budget(f"overhead {case.name}"):
            continue
        n_rounds = 3 if args.quick else case.rounds
        print(f"overhead {case.name}: {n_rounds} rounds ...")
        # NOTE: the control is a third model with its optimizer: 1B needs ~25 GB each.
        control = case.flavor == "debug" or memory_gib >= 120
        try:
            r = run_case(case, n_rounds, 2 if args.quick else 5, accum=1, control=control)
        except torch.cuda.OutOfMemoryError as e:
            # NOTE: A and B each hold a model and its optimizer; a small GPU may not fit two 1B.
            r = {"case": case.name, "error": f"out of memory: {e}".splitlines()[0]}
        free_cuda()
        overhead.append(r)
    results["throughput"] = throughput_rows = []
    for dtype in ("bfloat16", "float16"):
        if not within_budget(f"throughput {args.flavor} {dtype}"):
            continue
        print(f"throughput {args.flavor} {dtype}{' compiled' if args.compile else ''} ...")
        throughput_rows.append(
            throughput(
                args.flavor,
                dtype,
                args.batch_size,
                args.seq_len,
                2 if args.quick else 5,
                steps,
                args.compile,
                peak,
                args.ac,
            )
        )
        free_cuda()
    report(results)
    results["seconds"] = time.perf_counter() - start
    benchlib.write_json(args.out, NAME, args, results)


def report(results: dict) -> None:
    """Print the tables and the verdicts against the targets (recorded in ``results``)."""
    from hook_overhead import ratio_cell

    rows = []
    for r in results["overhead"]:
        if "error" in r:
            rows.append([r["case"], "", "", "", "", r["error"], "", "", ""])
            continue
        m = r["wall"]
        control = ratio_cell(m["control"]) if "control" in m else "-"
        rows.append([
            r["case"], f"{r['batch_size']}x{r['seq_len']}", r["rounds"],
            f"{m['b_seconds']['median'] * 1e3:.2f}", f"{m['a_seconds']['median'] * 1e3:.2f}",
            ratio_cell(m), control, f"{r['target_ratio']:.2f}",
            "yes" if m["target_met"] else "NO",
        ])  # fmt: skip
    print(
        "\nHook overhead on CUDA, wall time per step: A = plugtrain, B = hand-written loop,"
        " C = a second hand-written loop (control); ratios: median (95% CI) [IQR]\n"
    )
    print(
        benchlib.table(
            ["case", "batch", "rounds", "B ms", "A ms", "A/B", "control C/B", "target", "met"],
            rows,
        )
    )
    rows = []
    by_dtype = {r["dtype"]: r for r in results["throughput"]}
    for r in results["throughput"]:
        mfu = r["mfu"]
        rows.append([
            r["dtype"], r["compile"], f"{r['batch_size']}x{r['seq_len']}",
            ",".join(r["active_plugins"]), f"{r['step_seconds']['median'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}", f"{mfu:.1%}" if mfu is not None else "?",
            f"{r['peak_memory_gib']:.1f}", r["skipped_steps"],
        ])  # fmt: skip
    print(
        f"\n{results['flavor']} throughput (Trainer.train_step, grad_clip + grad_scaler enabled):\n"
    )
    print(
        benchlib.table(
            [
                "dtype",
                "compile",
                "batch",
                "active plugins",
                "step ms",
                "tokens/s",
                "MFU",
                "peak GiB",
                "skipped",
            ],
            rows,
        )
    )
    verdicts = {}
    bf16, fp16 = by_dtype.get("bfloat16"), by_dtype.get("float16")
    if bf16 and bf16["mfu"] is not None:
        verdicts["bf16_mfu_at_least_45pct"] = bf16["mfu"] >= MFU_TARGET
    if bf16 and fp16:
        ratio = fp16["tokens_per_s"] / bf16["tokens_per_s"]
        verdicts["fp16_over_bf16_tokens_per_s"] = ratio
        verdicts["fp16_within_3pct_of_bf16"] = ratio >= FP16_TARGET
    results["verdicts"] = verdicts
    print(f"\nverdicts: {verdicts}")


if __name__ == "__main__":
    main()
