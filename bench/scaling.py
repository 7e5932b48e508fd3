"""Tokens per second and memory per rank for 1 and 2 processes on CPU (FSDP2 over gloo).

Every configuration trains the same model on the same global batch, in fresh processes started
with torch.multiprocessing (what ``torchrun`` would start): ``1x1`` is one process with one
thread, ``2x1`` two processes with one thread each (data parallel over two cores);
``--configs 1x1,2x1,1x2`` adds one process with two threads (the same cores used by intra-op
parallelism instead). The configurations take turns over ``--rounds`` rounds (forward, then
backward), so a change in the machine's load hits them alike.

Per rank it reports the bytes of the local shards of the parameters, the gradients (read in
``post_backward``) and AdamW's state: deterministic numbers that show FSDP2 sharding them,
halved on each of two ranks. Peak resident memory (``ru_maxrss``) is reported too, with the
resident memory after importing torch, which every process pays.

    python bench/scaling.py             # about a minute
    python bench/scaling.py --quick
"""

from __future__ import annotations

import argparse
import resource
import time

import benchlib
import torch

from plugtrain.plugin import StepContext, hookimpl, local_tensor
from plugtrain.testing import run_distributed

NAME = "scaling"
MIB = 2**20


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the rank-local part of each tensor (a DTensor's local shard)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB


class GradBytes:
    """Records the bytes of this rank's gradient shards once they are complete."""

    def __init__(self) -> None:
        self.bytes = 0

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        self.bytes = tensor_bytes(ctx.gradients())


def worker(train_args: list[str], threads: int, warmup: int, steps: int) -> dict:
    """One rank: build the trainer, time ``steps`` steps after ``warmup``, measure its memory."""
    torch.set_num_threads(threads)
    rss_after_import = rss_mib()
    from plugtrain.training.launch import configure
    from plugtrain.training.trainer import Trainer

    config, host = configure(train_args)
    trainer = Trainer(config, host)
    probe = GradBytes()
    trainer.host.register(probe, "bench_grad_bytes")
    trainer.train_step(trainer.batches.next_batch())
    trainer.host.unregister(probe)
    for _ in range(warmup - 1):
        trainer.train_step(trainer.batches.next_batch())
    times = []
    for _ in range(steps):
        batch = trainer.batches.next_batch()
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    optimizer_state = [
        v for state in trainer.optimizer.state.values() for v in state.values() if v.dim() > 0
    ]
    return {
        "rank": trainer.parallel_dims.rank,
        "step_seconds": times,
        "param_bytes": tensor_bytes(list(trainer.model.parameters())),
        "grad_bytes": probe.bytes,
        "optimizer_state_bytes": tensor_bytes(optimizer_state),
        "rss_after_import_mib": rss_after_import,
        "peak_rss_mib": rss_mib(),
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", default="debug", help="model flavour (default: %(default)s)")
    parser.add_argument(
        "--dtype", default="float32", help="training.mixed_precision_param (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="global batch in sequences")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--configs",
        default="1x1,2x1",
        help="processes x threads per process, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the configurations")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    if args.quick:
        args.flavor, args.seq_len, args.batch_size = "tiny", 32, 4
        args.configs, args.rounds, args.steps = "1x1,2x1", 1, 2
    configs = [tuple(int(n) for n in c.split("x")) for c in args.configs.split(",")]
    train_args = benchlib.trainer_args(
        args.flavor,
        args.dtype,
        "--training.steps", "100000",
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )  # fmt: skip
    runs: dict[tuple[int, int], list[list[dict]]] = {c: [] for c in configs}
    for n, i in enumerate(benchlib.rounds(args.rounds, len(configs))):
        nproc, threads = configs[i]
        print(f"round {n // len(configs) + 1}: {nproc} process(es) x {threads} thread(s)")
        runs[nproc, threads].append(
            run_distributed(worker, nproc, train_args, threads, 2, args.steps)
        )
    tokens_per_step = args.batch_size * args.seq_len
    results, rows = [], []
    for (nproc, threads), rounds in runs.items():
        # Every rank waits for the others in each step's collectives: rank 0's time is the step's.
        step_s = benchlib.summary([t for ranks in rounds for t in ranks[0]["step_seconds"]])
        ranks = [
            {
                key: (max(r[key] for r in by_rank) if "rss" in key else by_rank[0][key])
                for key in (
                    "param_bytes", "grad_bytes", "optimizer_state_bytes",
                    "rss_after_import_mib", "peak_rss_mib",
                )
            }
            | {"rank": rank}
            for rank, by_rank in enumerate(zip(*rounds, strict=True))
        ]  # fmt: skip
        tokens_per_s = tokens_per_step / step_s["median"]
        results.append(
            {
                "processes": nproc,
                "threads_per_process": threads,
                "step_seconds": step_s,
                "tokens_per_s": tokens_per_s,
                "tokens_per_s_iqr": [
                    tokens_per_step / step_s["q3"],
                    tokens_per_step / step_s["q1"],
                ],
                "ranks": ranks,
            }
        )
        for r in ranks:
            rows.append([
                f"{nproc}x{threads}", r["rank"], f"{tokens_per_s:,.0f}",
                f"{tokens_per_step / step_s['q3']:,.0f}-{tokens_per_step / step_s['q1']:,.0f}",
                f"{r['param_bytes'] / MIB:.2f}", f"{r['grad_bytes'] / MIB:.2f}",
                f"{r['optimizer_state_bytes'] / MIB:.2f}",
                f"{r['peak_rss_mib']:.0f}", f"{r['peak_rss_mib'] - r['rss_after_import_mib']:.0f}",
            ])  # fmt: skip
    print(
        f"\n{args.flavor} model, {args.dtype}, global batch {args.batch_size} x {args.seq_len} "
        f"tokens, {args.steps} timed steps x {args.rounds} round(s)\n"
    )
    print(
        benchlib.table(
            [
                "procs x threads",
                "rank",
                "tokens/s (median)",
                "IQR",
                "params MiB",
                "grads MiB",
                "AdamW state MiB",
                "peak RSS MiB",
                "peak RSS - after import",
            ],
            rows,
        )
    )
    base = results[0]["tokens_per_s"]
    for r in results:
        r["speedup_vs_first_config"] = r["tokens_per_s"] / base
    benchlib.write_json(
        args.out,
        NAME,
        args,
        {
            "flavor": args.flavor,
            "dtype": args.dtype,
            "global_batch": args.batch_size,
            "seq_len": args.seq_len,
            "configs": results,
        },
    )


if __name__ == "__main__":
    main()
