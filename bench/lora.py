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
"""

from __future__ import annotations

import argparse
import time

import benchlib
import torch

from plugtrain.testing import PeakMemory
from plugtrain.training import Trainer
from plugtrain.training.launch import configure

NAME = "lora"
LORA = ("--plugins.enabled", "lora", "--lora.rank", "8", "--lora.alpha", "16")


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
