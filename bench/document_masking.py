"""Document masking (``model.attention = "document"``) against causal attention, on the CPU.

1. The fraction of the causal attention pairs (query, key at or before it) that document
   masking removes, for the shipped sample's training and validation splits at several
   sequence lengths: a pair is kept when both tokens lie in the same document.
2. The cost of a training step: ``Trainer.train_step`` with document masking (A: SDPA under a
   boolean block-diagonal causal mask, RoPE positions per document) against the same run with
   causal attention (B: SDPA's ``is_causal``), debug model, fp32, one process, alternated
   rounds on each run's own first batch; and the time to draw a batch (``next_batch``: A also
   reads the documents from the store's ``.idx`` and computes the positions).

    python bench/document_masking.py            # about a minute on one thread
    python bench/document_masking.py --quick    # seconds: 3 rounds
"""

from __future__ import annotations

import time
from typing import Any

import benchlib
import numpy as np
from hook_overhead import timed

from plugtrain import sample
from plugtrain.data import PackedDataset, open_token_store
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

NAME = "document_masking"
SEQ_LENS = (128, 512, 2048)
"""Sequence lengths of the masked-pairs fraction (128: the default run's)."""


def masked_fraction(split: str, seq_len: int) -> dict[str, Any]:
    """The fraction of causal pairs document masking removes over every sample of ``split``."""
    store = open_token_store(
        sample.resolve(f"sample:{split}.jsonl"),
        f"sample:{split}.jsonl",
        sample.resolve("sample:tokenizer.json"),
        "text",
    )
    data = PackedDataset(store, seq_len, documents=True)
    kept = 0
    for i in range(len(data)):
        sizes = np.bincount(data.sample_documents(i)).astype(np.int64)
        kept += int((sizes * (sizes + 1) // 2).sum())
    causal = len(data) * seq_len * (seq_len + 1) // 2
    return {
        "split": split,
        "seq_len": seq_len,
        "samples": len(data),
        "masked_fraction": 1 - kept / causal,
    }


def trainer(attention: str, steps: int) -> Trainer:
    args = benchlib.trainer_args("debug", "float32", "--training.steps", str(steps))
    args += ["--model.attention", attention, "--job.dump_folder"]
    args.append(str(benchlib.REPO / "outputs" / "bench" / f"run-{attention}"))
    configured = configure(args)
    assert configured is not None
    return Trainer(*configured)


def step_cost(n_rounds: int, warmup: int) -> dict[str, Any]:
    """Train steps and batch draws of A (document) and B (causal), alternated."""
    runs = [trainer(a, warmup + n_rounds + 1) for a in ("document", "causal")]
    batches = [run.batches.next_batch() for run in runs]
    assert batches[0][0].documents is not None and batches[1][0].documents is None
    for _ in range(warmup):
        for run, batch in zip(runs, batches, strict=True):
            run.train_step(batch)
    wall: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    draw: list[list[float]] = [[], []]
    for i in benchlib.rounds(n_rounds, 2):
        seconds, cpu_seconds, _ = timed(lambda b, run=runs[i]: run.train_step(b)[0], batches[i])
        wall[i].append(seconds)
        cpu[i].append(cpu_seconds)
        start = time.perf_counter()
        runs[i].batches.inner.loader.next_batch()  # the loader under prefetch and skips
        draw[i].append(time.perf_counter() - start)
    for run in runs:
        run.close()
    return {
        "flavor": "debug",
        "dtype": "float32",
        "batch_size": 8,
        "seq_len": 128,
        "warmup_steps": warmup,
        "rounds": n_rounds,
        "step_wall": benchlib.paired_ratio(*wall),
        "step_cpu": benchlib.paired_ratio(*cpu),
        "draw_wall": benchlib.paired_ratio(*draw),
    }


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0])
    fractions = [
        masked_fraction(split, seq_len)
        for split in ("train", "validation")
        for seq_len in SEQ_LENS[: 1 if args.quick else None]
    ]
    print(benchlib.table(["split", "seq_len", "samples", "masked pairs"], [
        [f["split"], f["seq_len"], f["samples"], f"{100 * f['masked_fraction']:.3f}%"]
        for f in fractions
    ]))  # fmt: skip
    cost = step_cost(3 if args.quick else 30, 1 if args.quick else 3)
    print()
    print(benchlib.table(["document / causal", "median", "q1", "q3", "95% CI"], [
        [key, cost[key]["ratio"]["median"], cost[key]["ratio"]["q1"], cost[key]["ratio"]["q3"],
         "{:.4g}-{:.4g}".format(*cost[key]["ratio_ci95"])]
        for key in ("step_wall", "step_cpu", "draw_wall")
    ]))  # fmt: skip
    benchlib.write_json(args.out, NAME, args, {"masked_pairs": fractions, "step_cost": cost})


if __name__ == "__main__":
    main()
