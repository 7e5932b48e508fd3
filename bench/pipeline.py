"""Pipeline parallelism on CPU: the measured bubble of 1F1B and ZBV against theory, and PP 2 vs 1.

Two gloo processes on loopback split the debug model (fp32, 4 blocks, untied output) with
``ModelSpec.pipeline_split``: 2 stages of 2 blocks for ``1F1B``, 4 stages of 1 block for
``ZBVZeroBubble`` (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: a V), and run
``torch.distributed.pipelining``'s schedule over ``m`` microbatches of 2 sequences of 128
tokens (forward, loss, backward; no optimizer step).

**Busy time** is the time a rank spends inside its stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (wrapped with a timer): the stage's
own compute, the loss on the last stage included. The waits for a neighbour's activations or
gradients, and the sends, are outside them: they are the bubble (and communication, which on
loopback is small). **Step time** is the wall time of ``schedule.step`` after a barrier. The
measured bubble of a rank is ``1 - busy / step``, to compare with
``training.pipeline_plan.bubble_fraction`` (which assumes balanced stages, free
communication and, for ZBV, equal forward, input-gradient and weight-gradient times).

**PP 2 vs 1 process**: the step time above against one process running the same
microbatches through the whole model, accumulating their gradients (what
``training.grad_accum_steps = m`` does on one process), with as many threads as one rank
(``--threads``): rank 0 runs it just before each pipelined step while
rank 1 waits, and the ratio is the median of each pair's (``benchlib.paired_ratio``): the
step time a 2-way pipeline gives with twice the cores. With a bubble ``b`` and no other cost
it would be about ``1 / (2 (1 - b))``.

CPU caveat: 2 processes on a 2-core machine shared with other work, with gloo's threads
competing for the same cores. The bubble measured here is noisy (several points of a step);
the medians over the steps are reported, with their spread in the JSON, and the fastest
pipelined step over the fastest 1-process one beside the median of the pairs' ratios: a
step of both ranks is slowed by whatever slows either.

GPU part (none here): on a machine with 2 or more GPUs, ``--device cuda`` runs the same
measure over NCCL (one GPU a rank; the timers synchronise the device); compare
``--microbatches 4,8,16`` with ``--flavor 1B`` (2 x 8 blocks) to see the bubble shrink as
``(pp - 1) / (m + pp - 1)`` for 1F1B and stay near 0 for ZBV.

    python bench/pipeline.py            # about 30 s on 2 cores
    python bench/pipeline.py --quick
"""

from __future__ import annotations

import argparse
import os
import time

import benchlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, schedules

from plugtrain.model import model_spec
from plugtrain.model.llama.args import FLAVORS
from plugtrain.testing import run_distributed
from plugtrain.training.pipeline_plan import bubble_fraction, rank_stages

NAME = "pipeline"
PP = 2
SEQS, SEQ_LEN = 2, 128
"""A microbatch: 2 sequences of 128 tokens."""
SCHEDULES = {
    "1F1B": (schedules.Schedule1F1B, 1),
    "ZBVZeroBubble": (schedules.ScheduleZBVZeroBubble, 2),
}
"""The schedules measured, with their torch class and stages per rank."""
TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch(flavor: str, microbatches: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The step's tokens and targets (the same on every rank and in the 1-process run)."""
    g = torch.Generator().manual_seed(0)
    vocab = FLAVORS[flavor].vocab_size
    data = torch.randint(0, vocab, (microbatches * SEQS, SEQ_LEN + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def model(flavor: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_spec("llama").build(FLAVORS[flavor]).to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(stage: PipelineStage, busy: list[float], device: torch.device) -> None:
    """Add the time of each of ``stage``'s compute calls to ``busy[0]``."""
    for name in TIMED:
        call = getattr(stage, name)

        def wrapper(*args, _call=call, **kwargs):
            synchronize(device)
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                synchronize(device)
                busy[0] += time.perf_counter() - start

        setattr(stage, name, wrapper)


def pipelined(flavor: str, schedule: str, microbatches: int, steps: int, device: str) -> dict:
    """One rank: ``steps`` (after one warm-up) of ``schedule``, busy and step seconds each."""
    rank = int(os.environ["RANK"])  # run_distributed's
    where = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(where)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    cls, per_rank = SCHEDULES[schedule]
    indices = rank_stages(schedule, PP, per_rank, rank)
    whole = model(flavor, where)  # the 1-process baseline's (the split prunes its model)
    parts = model_spec("llama").pipeline_split(model(flavor, where), PP * per_rank, indices)
    busy = [0.0]
    stages = []
    for index, part in zip(indices, parts, strict=True):
        stage = PipelineStage(part, index, PP * per_rank, where)
        timed(stage, busy, where)
        stages.append(stage)
    run = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    tokens, targets = batch(flavor, microbatches, where)
    holds_first, holds_last = 0 in indices, PP * per_rank - 1 in indices
    step_s, busy_s, alone_s = [], [], []
    for step in range(steps + 1):
        # Rank 0 first runs the batch through the whole model (rank 1 waits): the 1-process
        # step next to each pipelined one, so that both see the machine's load of the moment.
        if rank == 0:
            alone = whole_model_step(whole, tokens, targets, where)
        dist.barrier()
        for part in parts:
            part.zero_grad(set_to_none=True)
        busy[0] = 0.0
        start = time.perf_counter()
        run.step(*((tokens,) if holds_first else ()), **({"target": targets} if holds_last else {}))
        synchronize(where)
        if step:  # the first builds the schedule's buffers
            step_s.append(time.perf_counter() - start)
            busy_s.append(busy[0])
            alone_s.append(alone if rank == 0 else 0.0)
        dist.barrier()
    return {"step_s": step_s, "busy_s": busy_s, "alone_s": alone_s}


def whole_model_step(
    net: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, device: torch.device
) -> float:
    """Seconds of the step through the whole model: a forward and backward of each microbatch,
    the gradients accumulated (``training.grad_accum_steps`` on one process)."""
    net.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    for inputs, outputs in zip(tokens.split(SEQS), targets.split(SEQS), strict=True):
        loss_fn(net(inputs), outputs).backward()
    synchronize(device)
    return time.perf_counter() - start


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", default="debug", help="model flavour (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (default: %(default)s)")
    parser.add_argument(
        "--microbatches", default="4,8", help="microbatch counts (default: %(default)s)"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    if args.quick:
        args.steps = 2
    if args.device == "cuda" and torch.cuda.device_count() < PP:
        raise SystemExit(f"bench/pipeline.py: error: --device cuda needs {PP} GPUs")
    results, rows = [], []
    for m in (int(m) for m in args.microbatches.split(",")):
        for schedule, (_, per_rank) in SCHEDULES.items():
            per_rank_results = run_distributed(
                pipelined, PP, args.flavor, schedule, m, args.steps, args.device
            )
            theory = bubble_fraction(schedule, PP, per_rank, m)
            ranks = []
            for rank, r in enumerate(per_rank_results):
                bubbles = [1 - b / s for b, s in zip(r["busy_s"], r["step_s"], strict=True)]
                ranks.append(
                    {
                        "rank": rank,
                        "step_s": benchlib.summary(r["step_s"]),
                        "busy_s": benchlib.summary(r["busy_s"]),
                        "bubble": benchlib.summary(bubbles),
                    }
                )
            first = per_rank_results[0]
            versus = benchlib.paired_ratio(first["step_s"], first["alone_s"])
            step, alone = versus["a_seconds"]["median"], versus["b_seconds"]["median"]
            fastest = versus["a_seconds"]["min"] / versus["b_seconds"]["min"]
            results.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "bubble_theory": float(theory),
                    "ranks": ranks,
                    "pp2_over_one_process": versus,
                }
            )
            rows.append(
                [schedule, m, f"{theory} = {float(theory):.1%}"]
                + [f"{rank['bubble']['median']:.1%}" for rank in ranks]
                + [step * 1e3, alone * 1e3, versus["ratio"]["median"], fastest]
            )
    print(
        f"\n{args.flavor} model, fp32, {PP} processes ({args.device}), microbatches of {SEQS} x "
        f"{SEQ_LEN} tokens, medians of {args.steps} steps\n"
    )
    print(
        benchlib.table(
            ["schedule", "m", "bubble (theory)", "rank 0 bubble", "rank 1 bubble",
             "PP 2 step ms", "1 process ms", "PP 2 / 1", "fastest / fastest"],
            rows,
        )
    )  # fmt: skip
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
