"""LoRA against full fine-tuning, debug model, CPU, fp32: peak memory, optimizer state, step time.

Both runs are built in one process from the same seed: full fine-tuning (every parameter
trains, fused AdamW) and the ``lora`` plugin (rank 8 on all seven projections, the base
frozen). Their first steps run under ``plugtrain.testing.PeakMemory``, which counts the bytes
of the tensors a step creates (activations kept for backward, gradients, and AdamW's state,
made at the first step); the optimizer state is the bytes of AdamW's tensors after it. Then
the two take turns, one step each per round on the same batch, and the step time's ratio is
the median of the rounds' ratios with its bootstrap 95% interval.

    python bench/lora.py           # about a minute on 2 cores
    python bench/lora.py --quick   # 3 rounds

On a GPU, :func:`gpu_memory` measures one mode (full fine-tuning, LoRA or QLoRA, the base in
NF4) of a Llama 3 8B-shaped model: ``bench/gpu_check.py``'s ``mem-8B-*`` parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Iterable

import benchlib
import torch
from torch.distributed.tensor import DTensor

from plugtrain.testing import PeakMemory
from plugtrain.training import Trainer
from plugtrain.training.launch import configure

NAME = "lora"
LORA = ("--plugins.enabled", "lora", "--lora.rank", "8", "--lora.alpha", "16")
ADAPTED = ("--plugins.enabled", "lora,activation_checkpointing", *LORA[2:])
MODES = {
    "full": ("--plugins.enabled", "activation_checkpointing"),
    "lora": ADAPTED,
    "qlora": (*ADAPTED, "--lora.base_dtype", "nf4"),
}
"""The GPU memory parts' runs: each with full activation checkpointing, so that what differs
is what the modes hold (weights, gradients, AdamW's moments)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", default="debug", help="model.flavor (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default: 20)")


def build(flavor: str, name: str, *extra: str) -> Trainer:
    args = benchlib.trainer_args(flavor, "float32", *extra)
    folder = benchlib.REPO / "outputs" / "bench" / f"{NAME}-{name}"
    configured = configure([*args, "--job.dump_folder", str(folder)])
    assert configured is not None
    return Trainer(*configured)


def optimizer_bytes(trainer: Trainer) -> int:
    """The bytes of the optimizer's per-parameter tensors (AdamW's moments; its step counts)."""
    return sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )


def shape_args(flavor: str, layers: int | None) -> list[str]:
    """Config arguments for ``flavor``'s shape, its vocabulary included (not the sample
    tokenizer's), with ``layers`` blocks if given: a Hugging Face config.json of that shape,
    written under outputs/bench/."""
    from plugtrain.model import FLAVORS, hf_config

    args = FLAVORS[flavor]
    args = dataclasses.replace(args, n_layers=layers or args.n_layers)
    config = hf_config(args, dtype=torch.bfloat16, bos_token_id=None, eos_token_id=None)
    path = benchlib.REPO / "outputs" / "bench" / f"{NAME}-{flavor}x{args.n_layers}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return ["--model.flavor", "hf", "--model.hf_config", str(path)]


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes this process holds of ``tensors``: a DTensor's shard, an NF4 weight's
    quantised values and scales."""
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            total += held_bytes(getattr(t, name) for name in t.__tensor_flatten__()[0])
        else:
            total += t.numel() * t.element_size()
    return total


def gpu_memory(
    mode: str, shape: list[str], dtype: str, batch: int, seq: int, warmup: int, steps: int
) -> dict:
    """Memory and speed of one ``mode`` (``MODES``) on ``cuda:0`` (the CUDA calls stood in for
    by a dry run): the peak while the model is built and initialised, what it holds then, the
    peak of the training steps after ``warmup``, the bytes of the weights and of AdamW's state
    held, the memory estimate's total for the same run, and tokens/s."""
    from hook_overhead import timed

    from plugtrain.model import conversion_of
    from plugtrain.training import estimate_run

    torch.cuda.reset_peak_memory_stats()
    train_args = benchlib.trainer_args(
        "debug", dtype, *shape, *MODES[mode], "--training.steps", str(warmup + steps + 1),
        "--activation_checkpointing.mode", "full", batch_size=batch, seq_len=seq,
    )  # fmt: skip
    trainer = Trainer(*configure(train_args))
    built, build_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    params = dict(trainer.model.named_parameters())
    for _ in range(warmup):
        trainer.train_step(trainer.batches.next_batch())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        batch_ = trainer.batches.next_batch()
        seconds.append(timed(lambda b: trainer.train_step(b)[0], batch_)[0])
    nf4 = [params[name] for name in conversion_of(trainer.model).stored]
    estimate = estimate_run(trainer.config, 1, model=trainer.model)
    step_s = benchlib.summary(seconds)
    return {
        "mode": mode,
        "dtype": dtype,
        "parameters": sum(p.numel() for p in params.values()),
        "trainable": sum(p.numel() for p in params.values() if p.requires_grad),
        "batch_size": batch,
        "seq_len": seq,
        "weight_bytes": held_bytes(params.values()),
        "nf4_bytes_per_value": held_bytes(nf4) / sum(p.numel() for p in nf4) if nf4 else None,
        "optimizer_state_bytes": optimizer_bytes(trainer),
        "built_gib": built / 2**30,
        "build_peak_gib": build_peak / 2**30,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "estimate_gib": estimate.total / 2**30,
        "step_seconds": step_s,
        "tokens_per_s": batch * seq / step_s["median"],
        "mfu": None,
    }


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    runs = {"full": build(args.flavor, "full"), "lora": build(args.flavor, "lora", *LORA)}
    batch = runs["full"].batches.next_batch()
    measured = {}
    for name, trainer in runs.items():
        trainer.model.train()
        with PeakMemory() as memory:
            trainer.train_step(batch)
        params = list(trainer.model.parameters())
        measured[name] = {
            "parameters": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "step_peak_bytes": memory.peak,
            "optimizer_state_bytes": optimizer_bytes(trainer),
        }
    seconds: dict[str, list[float]] = {"full": [], "lora": []}
    names = list(runs)
    for i in benchlib.rounds(3 if args.quick else args.rounds, len(names)):
        start = time.perf_counter()
        runs[names[i]].train_step(batch)
        seconds[names[i]].append(time.perf_counter() - start)
    full, lora = measured["full"], measured["lora"]
    total = {k: v["parameter_bytes"] + v["step_peak_bytes"] for k, v in measured.items()}
    results = {
        "flavor": args.flavor,
        "runs": measured,
        "peak_total_bytes": total,
        "lora_vs_full": {
            "trainable": lora["trainable"] / full["trainable"],
            "step_peak": lora["step_peak_bytes"] / full["step_peak_bytes"],
            "peak_total": total["lora"] / total["full"],
            "optimizer_state": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
            "step_time": benchlib.paired_ratio(seconds["lora"], seconds["full"]),
        },
    }
    ratio = results["lora_vs_full"]
    time_ratio = ratio["step_time"]
    print(
        benchlib.table(
            ["", "trainable params", "step peak MiB", "params + peak MiB", "optimizer MiB"],
            [
                [
                    k,
                    v["trainable"],
                    v["step_peak_bytes"] / 2**20,
                    total[k] / 2**20,
                    v["optimizer_state_bytes"] / 2**20,
                ]
                for k, v in measured.items()
            ]
            + [
                [
                    "lora / full",
                    ratio["trainable"],
                    ratio["step_peak"],
                    ratio["peak_total"],
                    ratio["optimizer_state"],
                ]
            ],
        )
    )
    print(
        f"\nstep time lora / full: {time_ratio['ratio']['median']:.3f} "
        f"[{time_ratio['ratio_ci95'][0]:.3f}, {time_ratio['ratio_ci95'][1]:.3f}] (95% CI), "
        f"{len(seconds['lora'])} rounds"
    )
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
