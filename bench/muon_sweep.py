"""Muon against AdamW on the shipped sample: validation loss after 200 steps, each at the best
of its peak learning rates.

The default run (``python train.py``: the debug model, fp32, 1 process, 200 steps, cosine
schedule with 20 warmup steps, validation every 50 steps on 4 batches), trained six times in
this process: AdamW (the core's, ``optimizer.lr``) and the ``muon`` plugin (``muon.lr`` for the
matrices; the embedding, output and norms keep AdamW at the default ``optimizer.lr``), at
three (AdamW) and four (Muon) peak LRs around each one's usual value. Every run starts from the
same weights and sees the same batches; only the optimizer differs. Results are written after
every run, so an interrupted sweep keeps what it measured; ``--only`` runs part of the grid.

    python bench/muon_sweep.py                # 7 runs of 200 steps: many minutes on 2 CPU cores
    python bench/muon_sweep.py --steps 60     # shorter runs (schedule and validation at the end)
    python bench/muon_sweep.py --only muon:0.01,muon:0.08   # two runs of the grid
    python bench/muon_sweep.py --quick        # 7 runs of 20 steps
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import benchlib

from plugtrain.training import Trainer, configure

NAME = "muon_sweep"
SWEEP = {
    "adamw": ("optimizer.lr", [1e-3, 3e-3, 1e-2]),
    "muon": ("muon.lr", [0.01, 0.02, 0.04, 0.08]),
}
"""Each optimizer's swept key and peak LRs (AdamW's default 3e-3 and Muon's 0.02 second)."""


def train(folder: Path, optimizer: str, lr: float, steps: int) -> dict[str, float]:
    """One run of the default config with ``optimizer`` at peak ``lr``; its final numbers."""
    key, _ = SWEEP[optimizer]
    argv = ["--job.dump_folder", str(folder), f"--{key}", str(lr)]
    argv += ["--checkpoint.save_final", "false"]  # the sweep times steps, not a save
    if optimizer == "muon":
        argv += ["--plugins.enabled", "muon"]
    if steps != 200:  # the default run's length: its validation every 50 steps
        argv += ["--training.steps", str(steps), "--validation.interval", str(steps)]
    configured = configure(argv)
    assert configured is not None
    trainer = Trainer(*configured)
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if "validation_loss" in r]
    losses = [r for r in records if "loss" in r]
    return {
        "steps": trainer.step,
        "validation_loss": validation[-1]["validation_loss"],
        "validation_losses": {str(r["step"]): r["validation_loss"] for r in validation},
        "final_train_loss": losses[-1]["loss"],
        "seconds": seconds,
    }


def best_of(runs: list[dict]) -> dict[str, dict]:
    """Each optimizer's run with the lowest final validation loss, among ``runs``."""
    best: dict[str, dict] = {}
    for run in runs:
        if (
            run["optimizer"] not in best
            or run["validation_loss"] < best[run["optimizer"]]["validation_loss"]
        ):
            best[run["optimizer"]] = run
    return best


def main() -> None:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=200, help="steps per run")
        parser.add_argument(
            "--only", default="", help="comma-separated OPTIMIZER:LR of the grid to run (all)"
        )

    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add)
    steps = 20 if args.quick else args.steps
    # Interleaved, the usual LRs first: a sweep cut short still compares the two.
    order = [
        (o, key, lrs[i]) for i in (1, 2, 0, 3) for o, (key, lrs) in SWEEP.items() if i < len(lrs)
    ]
    if args.only:
        wanted = set(args.only.split(","))
        grid = {f"{o}:{lr:g}" for o, _, lr in order}
        if not wanted <= grid:
            print(
                f"--only: {sorted(wanted - grid)} not in the grid {sorted(grid)}", file=sys.stderr
            )
            raise SystemExit(2)
        order = [run for run in order if f"{run[0]}:{run[2]:g}" in wanted]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, key, lr in order:
            folder = Path(tmp) / f"{optimizer}-{lr}"
            runs.append({"optimizer": optimizer, "key": key, "lr": lr,
                         **train(folder, optimizer, lr, steps)})  # fmt: skip
            benchlib.write_json(args.out, NAME, args, {"runs": runs, "best": best_of(runs)})
    best = best_of(runs)
    print(benchlib.table(
        ["optimizer", "swept", "peak lr", "steps", "validation loss", "train loss", "s"],
        [[r["optimizer"], r["key"], r["lr"], r["steps"], r["validation_loss"],
          r["final_train_loss"], r["seconds"]] for r in runs],
    ))  # fmt: skip
    for optimizer, run in best.items():
        loss = run["validation_loss"]
        print(f"best {optimizer}: {run['key']} {run['lr']}, validation loss {loss:.4f}")
    if {"adamw", "muon"} <= best.keys():
        ratio = best["muon"]["seconds"] / best["adamw"]["seconds"]
        delta = best["muon"]["validation_loss"] - best["adamw"]["validation_loss"]
        print(f"muon - adamw validation loss: {delta:+.4f}; time ratio muon/adamw: {ratio:.2f}")


if __name__ == "__main__":
    main()
