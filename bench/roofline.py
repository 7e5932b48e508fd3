"""How close plugtrain's training step comes to the machine's limit: the CPU roofline.

For each case (the debug model at the default run's batch, and a ~50M-parameter shape) and
thread count, this script times ``Trainer.train_step`` and reports its model FLOP/s
(``ModelArgs.flops_per_token``, the formula a run's MFU uses) against two ceilings:

(a) the step's own GEMMs alone: torch's ``mm``/``bmm`` at every GEMM shape the step makes
    (``ModelArgs.gemms``: the projections' forward, input and weight gradients, the attention's
    six products per layer), each shape alone, timed in turns with the step, as a run's
    ``mfu_matmul_pct`` does. It says what the step loses outside its GEMMs, at its own shapes
    and thread count; at small shapes it is far below the machine's best, and the step can
    beat it by a few percent (its backward multiplies transposed views, which the timing
    does not).
(b) the machine's best fp32 GEMM throughput: a large square ``mm``, the fastest of several
    warm runs, at all threads (and at each thread count measured), before and after the cases.
    No fp32 step on this machine can go faster: the physical figure to quote.

A profile of a few more steps splits the step's time: GEMMs, attention, the loss, the
optimizer, the other operators (norms, activations, RoPE, copies), plugtrain's hooks, and what
no operator accounts for (autograd and Python). Target: >= 0.70 of (a) at the ~50M shape, fp32.

    python bench/roofline.py             # a few minutes on 2 cores
    python bench/roofline.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import benchlib
import torch
from torch.profiler import ProfilerActivity, profile

from plugtrain.model import FLAVORS, Gemm, ModelArgs, hf_config
from plugtrain.observability.limits import matmul_seconds
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

NAME = "roofline"
TARGET = 0.70
VOCAB = 2048  # the shipped tokenizer's
SQUARE = 2048
"""The side of ceiling (b)'s square GEMM (``--quick``: half): large enough for the BLAS's best
kernel, small enough to time in a second or two."""


@dataclass(frozen=True)
class Case:
    name: str
    args: ModelArgs
    batch_size: int
    seq_len: int


CASES = (
    Case("debug", replace(FLAVORS["debug"], vocab_size=VOCAB), 8, 128),
    Case(
        "50M",
        ModelArgs(dim=512, n_layers=14, n_heads=8, n_kv_heads=8, vocab_size=VOCAB, max_seq_len=512),
        4,
        256,
    ),
)

# (category, substrings of the profiler's operator names), first match wins. The operator's
# own time (self time) is counted, so that a composite op is not counted twice.
CATEGORIES = (
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
    ("optimizer", ("adam", "_foreach_")),
    ("other operators", ("aten::",)),
)


def build(case: Case, folder: Path) -> Trainer:
    """plugtrain's trainer for ``case``'s shape (given as a config.json), fp32, no plugins."""
    config_json = hf_config(case.args, dtype=torch.float32, bos_token_id=None, eos_token_id=None)
    (folder / "config.json").write_text(json.dumps(config_json))
    argv = benchlib.trainer_args(
        "hf",
        "float32",
        "--model.hf_config", str(folder),
        "--training.steps", "1000000",
        batch_size=case.batch_size,
        seq_len=case.seq_len,
    )  # fmt: skip
    return Trainer(*configure(argv))


def profile_split(trainer: Trainer, batch, steps: int) -> dict[str, float]:
    """The fraction of ``steps`` steps' wall time in each category (see :data:`CATEGORIES`),
    ``hooks`` from the trainer's step timer, and ``unattributed`` for the rest."""
    trainer.timer.window()  # start a fresh window of the phase timer
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step(batch)[0].item()
    wall = time.perf_counter() - start
    split = dict.fromkeys([c for c, _ in CATEGORIES], 0.0)
    for event in prof.key_averages():
        name = event.key.lower()
        category = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), None)
        if category is not None:
            split[category] += event.self_cpu_time_total / 1e6
    split["hooks"] = trainer.timer.window()["time_hooks_s"] * steps
    split["unattributed"] = wall - sum(split.values())
    return {k: v / wall for k, v in split.items()}


def run_case(case: Case, threads: int, rounds: int, warmup: int) -> dict:
    """Steps and the matmul limit in turns at ``threads`` threads, then the profile split."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:
        trainer = build(case, Path(folder))
        batch = trainer.batches.next_batch()
        rows = case.batch_size  # one process, one microbatch
        gemms = case.args.gemms(rows, case.seq_len)
        device = trainer.device
        for _ in range(warmup):
            trainer.train_step(batch)[0].item()
        step_s: list[float] = []
        limit_s: list[float] = []
        for i in benchlib.rounds(rounds, 2):
            if i == 0:
                start = time.perf_counter()
                trainer.train_step(batch)[0].item()
                step_s.append(time.perf_counter() - start)
            else:
                limit_s.append(matmul_seconds(gemms, device, torch.float32, repeats=1))
        split = profile_split(trainer, batch, steps=2)
        trainer.close()
    flops = trainer.model_args.flops_per_token(case.seq_len) * rows * case.seq_len
    ratio = benchlib.paired_ratio(limit_s, step_s)
    achieved = benchlib.summary([flops / s for s in step_s])
    limit = benchlib.summary([flops / s for s in limit_s])
    return {
        "case": case.name,
        "threads": threads,
        "parameters": case.args.num_params(),
        "tokens_per_step": rows * case.seq_len,
        "model_flops_per_step": flops,
        "gemm_flops_per_step": sum(g.flops for g in gemms),
        "achieved_gflops": {k: v / 1e9 if k != "n" else v for k, v in achieved.items()},
        "matmul_limit_gflops": {k: v / 1e9 if k != "n" else v for k, v in limit.items()},
        "fraction_of_limit": ratio,
        "step_seconds": step_s,
        "target": TARGET if case.name == "50M" else None,
        "profile_split": split,
    }


def machine_gemm(side: int, thread_counts: list[int], repeats: int) -> dict:
    """Ceiling (b): the best fp32 GFLOP/s of a ``side``-cubed ``mm``, the fastest of
    ``repeats`` warm runs, at every thread count of the machine's (``os.cpu_count()``) and
    ``thread_counts``, and the thread count that reached it."""
    saved = torch.get_num_threads()
    square = [Gemm("square", side, side, side)]
    best = (0.0, 0)
    for threads in sorted({os.cpu_count() or 1, *thread_counts}):
        torch.set_num_threads(threads)
        seconds = matmul_seconds(square, torch.device("cpu"), torch.float32, repeats)
        best = max(best, (square[0].flops / seconds / 1e9, threads))
    torch.set_num_threads(saved)
    return {"side": side, "repeats": repeats, "gflops": best[0], "threads": best[1]}


def against_machine(result: dict, machine: dict) -> dict:
    """``result``'s step against ceiling (b), ``machine``: each round's fraction, summarised as
    ``fraction_of_limit`` is (``ratio``, ``ratio_ci95``: the median's 95% CI)."""
    flops = result["model_flops_per_step"]
    fractions = [flops / s / 1e9 / machine["gflops"] for s in result["step_seconds"]]
    return {
        "machine_gemm": machine,
        "fraction_of_machine": {
            "ratio": benchlib.summary(fractions),
            "ratio_ci95": benchlib.median_ci(fractions),
        },
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--thread-counts",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch intra-op threads to measure at (default: %(default)s)",
    )


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    rounds, warmup = (2, 1) if args.quick else (8, 2)
    side, repeats = (SQUARE // 2, 2) if args.quick else (SQUARE, 5)
    before = machine_gemm(side, args.thread_counts, repeats)
    results = [
        run_case(case, threads, rounds, warmup)
        for case in (CASES[:1] if args.quick else CASES)
        for threads in args.thread_counts
    ]
    after = machine_gemm(side, args.thread_counts, repeats)
    machine = max(before, after, key=lambda m: m["gflops"])
    for r in results:
        r.update(against_machine(r, machine))
    print(
        f"(b) the machine's best fp32 GEMM: {machine['gflops']:.1f} GFLOP/s ({side}^3 mm, "
        f"{machine['threads']} threads, fastest of {repeats} warm runs; before the cases "
        f"{before['gflops']:.1f}, after {after['gflops']:.1f})\n"
    )
    print(
        benchlib.table(
            [
                "case", "threads", "achieved GFLOP/s", "(a) step's GEMMs alone GFLOP/s",
                "fraction of (a) [95% CI]", "fraction of (b) [95% CI]",
            ],
            [
                [
                    r["case"],
                    r["threads"],
                    r["achieved_gflops"]["median"],
                    r["matmul_limit_gflops"]["median"],
                    _fraction(r["fraction_of_limit"]),
                    _fraction(r["fraction_of_machine"]),
                ]
                for r in results
            ],
        )
    )  # fmt: skip
    categories = list(results[0]["profile_split"])
    print()
    print(
        benchlib.table(
            ["case", "threads", *categories],
            [
                [r["case"], r["threads"], *(f"{r['profile_split'][c]:.1%}" for c in categories)]
                for r in results
            ],
        )
    )
    benchlib.write_json(args.out, NAME, args, results)


def _fraction(fraction: dict) -> str:
    lo, hi = fraction["ratio_ci95"]
    return f"{fraction['ratio']['median']:.3f} [{lo:.3f}, {hi:.3f}]"


if __name__ == "__main__":
    main()
