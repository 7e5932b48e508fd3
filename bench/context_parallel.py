"""Context parallelism on CPU: activation memory per rank against seq_len, and the step's time,
at cp 1, 2 and 4 (gloo processes), for both methods (all-gather and Ulysses).

Part 1, counted: the bytes one training forward keeps for its backward on each rank
(``plugtrain.testing.saved_activation_bytes``: every tensor autograd saves, the parameters left
out; deterministic, unlike a peak), the debug model in fp32, one row of ``--seq-lens`` tokens,
on 1 process, on 2 ranks at cp 2 and on 4 at cp 4; the larger rank's, and its ratio to cp 1's.
Each rank holds ``1 / cp`` of every row, and Ulysses ``1 / cp`` of the heads over the whole
row: about ``1 / cp`` of the bytes. The all-gather method also keeps the whole row's keys and
values as gathered, a fixed share above ``1 / cp`` at every seq_len
(docs/benchmarks/context_parallel.md).

Part 2, timed: a training step (forward, backward, AdamW) of the same global batch
(``--batch`` rows of ``--timing-seq-len`` tokens) on 1 process and at cp 2 and cp 4 on 2 and 4
processes, one intra-op thread each: the median of ``--steps`` steps after one warm-up step,
in wall seconds (rank 0's: every rank waits for the others in the step's collectives) and in
CPU seconds (all ranks' added up: the work CP adds, less sensitive to other load), each against
the one process's. On 2 CPU cores shared with other work, as here, 4 processes share 2
cores and every multi-process wall time is pessimistic: cp 2 can at best halve the step, cp 4
do no better than cp 2.

    python bench/context_parallel.py           # about 70 s on 2 cores
    python bench/context_parallel.py --quick   # short rows and 2 steps: checks that it runs

GPU part (not run here: no GPU). On a machine with >= 2 GPUs, the 1B model in bf16, one row
of 32768 tokens per step, cp 1 against cp 2 for each method; compare the ``memory_gib`` (CUDA
max allocated) and ``tokens_per_sec_per_rank`` of each run's ``metrics.jsonl`` (steps 5
to 20)::

    torchrun --nproc_per_node 1 train.py --model.flavor 1B --training.seq_len 32768 \
        --training.batch_size 1 --training.steps 20 \
        --training.mixed_precision_param bfloat16 --parallelism.cp 1
    torchrun --nproc_per_node 2 train.py --model.flavor 1B --training.seq_len 32768 \
        --training.batch_size 1 --training.steps 20 \
        --training.mixed_precision_param bfloat16 --parallelism.cp 2 \
        --parallelism.cp_method allgather        # then ulysses

cp 2's ``memory_gib`` less the parameters', gradients' and AdamW's share (FSDP shards those over
the cp ranks too: ``plugtrain estimate``) should be near the ratios of part 1 (0.55 all-gather,
0.52 Ulysses) of cp 1's; its tokens per second per rank against cp 1's is the time CP costs
(on CUDA the all-gather method pads a chunk's queries to its keys' length: more than on the
CPU, whose kernel it runs by blocks). If cp 1 runs out of memory, that is a
result: add ``--plugins.enabled activation_checkpointing --activation_checkpointing.mode
full`` to every run. At 4 and 8 GPUs, cp 4 and cp 8 at 65536 and 131072 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchlib
import torch

from plugtrain.testing import make_trainer, run_distributed, saved_activation_bytes

NAME = "context_parallel"
METHODS = ("allgather", "ulysses")
DEGREES = (2, 4)
MIB = 2**20


def layout(cp: int, method: str) -> tuple[str, ...]:
    if cp == 1:
        return ()
    return ("--parallelism.cp", str(cp), "--parallelism.cp_method", method)


def trainer(folder: str, cp: int, method: str, seq_len: int, batch: int):
    args = benchlib.trainer_args(
        "debug", "float32", *layout(cp, method), batch_size=batch, seq_len=seq_len
    )
    return make_trainer(folder, *args[2:], steps=10**6)  # [2:]: make_trainer's dump folder


def measure(cp: int, cli: dict, folder: str) -> dict:
    """On each rank (or the one process at cp 1): the saved bytes of one forward by method
    and seq_len, and the wall and CPU seconds of each timed step by method."""
    torch.set_num_threads(cli["threads"])
    methods = METHODS[:1] if cp == 1 else METHODS  # cp 1 has no method
    saved: dict[str, dict[int, int]] = {}
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for method in methods:
        saved[method] = {}
        for seq_len in cli["seq_lens"]:
            run = trainer(f"{folder}/memory_{method}_{seq_len}", cp, method, seq_len, 1)
            saved[method][seq_len] = saved_activation_bytes(run, run.batches.next_batch()[0])
            run.abort()
        run = trainer(f"{folder}/time_{method}", cp, method, cli["timing_seq_len"], cli["batch"])
        run.train_step(run.batches.next_batch())  # warm-up
        seconds[method], cpu[method] = [], []
        for _ in range(cli["steps"]):
            batch = run.batches.next_batch()
            start, start_cpu = time.perf_counter(), time.process_time()
            run.train_step(batch)
            seconds[method].append(time.perf_counter() - start)
            cpu[method].append(time.process_time() - start_cpu)
        run.abort()
    return {"saved_bytes": saved, "step_seconds": seconds, "step_cpu_seconds": cpu}


def timed(cp: int, method: str, measured: list[dict], one: dict) -> dict:
    """Part 2's row of ``cp``'s ranks (``measured``): rank 0's wall seconds per step, every
    rank's CPU seconds per step added up, and each median's ratio to the one process's."""
    wall = benchlib.summary(measured[0]["step_seconds"][method])
    steps = zip(*(r["step_cpu_seconds"][method] for r in measured), strict=True)
    cpu = benchlib.summary([sum(ranks) for ranks in steps])
    return {
        "processes": cp,
        "method": method if cp > 1 else None,
        "step_seconds": wall,
        "step_cpu_seconds": cpu,
        "wall_ratio": wall["median"] / statistics.median(one["step_seconds"]["allgather"]),
        "cpu_ratio": cpu["median"] / statistics.median(one["step_cpu_seconds"]["allgather"]),
    }


def main() -> None:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--seq-lens", default="512,1024,2048,4096", help="part 1's rows")
        parser.add_argument("--timing-seq-len", type=int, default=2048, help="part 2's rows")
        parser.add_argument("--batch", type=int, default=2, help="part 2's rows per step")
        parser.add_argument("--steps", type=int, default=4, help="part 2's timed steps")

    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add)
    if args.quick:
        args.seq_lens, args.timing_seq_len, args.steps = "256,512", 256, 2
    cli = {
        "seq_lens": [int(s) for s in args.seq_lens.split(",")],
        "timing_seq_len": args.timing_seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "threads": args.threads,
    }
    folder = str(benchlib.REPO / "outputs" / "bench" / NAME)
    ranks = {1: [measure(1, cli, f"{folder}/cp1")]}
    for cp in DEGREES:
        ranks[cp] = run_distributed(measure, cp, cp, cli, f"{folder}/cp{cp}")

    one = ranks[1][0]
    memory, timing = [], []
    for cp, measured in ranks.items():
        for method in measured[0]["saved_bytes"]:
            for seq_len in cli["seq_lens"]:
                per_rank = [r["saved_bytes"][method][seq_len] for r in measured]
                memory.append({
                    "cp": cp, "method": method if cp > 1 else None, "seq_len": seq_len,
                    "bytes_per_rank": per_rank,
                    "ratio_to_cp1": max(per_rank) / one["saved_bytes"]["allgather"][seq_len],
                })  # fmt: skip
            timing.append(timed(cp, method, measured, one))

    print("\ndebug model, fp32, 1 row: bytes one forward saves for its backward, larger rank\n")
    print(
        benchlib.table(
            ["cp", "method", "seq_len", "MiB per rank", "/ cp 1", "1 / cp"],
            [
                [
                    m["cp"],
                    m["method"] or "-",
                    m["seq_len"],
                    max(m["bytes_per_rank"]) / MIB,
                    m["ratio_to_cp1"],
                    1 / m["cp"],
                ]
                for m in memory
            ],
        )
    )
    print(
        f"\ndebug model, fp32, global batch {cli['batch']} x {cli['timing_seq_len']} tokens, "
        f"{cli['steps']} timed steps, {args.threads} thread(s) per process; wall: rank 0's, "
        "CPU: all ranks'\n"
    )
    print(
        benchlib.table(
            ["processes", "method", "wall s (median)", "min", "max", "/ 1 process",
             "CPU s (median)", "/ 1 process"],
            [
                [t["processes"], t["method"] or "-", t["step_seconds"]["median"],
                 t["step_seconds"]["min"], t["step_seconds"]["max"], t["wall_ratio"],
                 t["step_cpu_seconds"]["median"], t["cpu_ratio"]]
                for t in timing
            ],
        )
    )  # fmt: skip
    results = {"flavor": "debug", "dtype": "float32", **cli, "memory": memory, "timing": timing}
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
