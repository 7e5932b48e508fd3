"""``plugtrain eval``: downstream tasks scored on a saved model, on one or several processes.

The model comes from any input ``plugtrain generate`` reads (a dump folder's latest checkpoint,
a ``step-N`` folder, an exported Hugging Face folder;
:func:`plugtrain.commands.generate.load`), whole on each process; the tasks are scored by
:func:`plugtrain.evaluation.score`, the scorer of the ``downstream_eval`` plugin, so the numbers
are those the plugin logs for the same items. Under
``torchrun`` the items are split over the processes and the counts summed. Rank 0 prints a
table (accuracy with its 95% Wilson interval) and writes the JSON file ``-o`` names, and
``--log-samples`` each item's per-choice log-likelihoods, in lm-eval's ``--log_samples`` shape
(:mod:`plugtrain.evaluation.samples`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from plugtrain.commands.generate import add_model_arguments, load
from plugtrain.errors import ConfigError
from plugtrain.evaluation import (
    Score,
    encode_tasks,
    read_task,
    sample_records,
    score_items,
    wilson_interval,
)

__all__ = ["add_parser", "results", "run"]


def _device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda asks for a GPU, but none is available: use cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def results(scores: dict[str, Score], paths: list[str]) -> dict[str, dict]:
    """Each task's numbers as ``-o`` writes them: items, ``acc`` and ``acc_norm`` with their 95%
    Wilson intervals, the task file."""
    out = {}
    for (name, s), path in zip(scores.items(), paths, strict=True):
        out[name] = {
            "path": path,
            "items": s.items,
            "acc": s.acc,
            "acc_95": list(wilson_interval(s.correct, s.items)),
            "acc_norm": s.acc_norm,
            "acc_norm_95": list(wilson_interval(s.correct_norm, s.items)),
        }
    return out


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain eval``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "eval",
        help=summary,
        description="Score the multiple-choice tasks of JSONL files ({context, choices, gold}, "
        "or HellaSwag's own validation file) on the model of a run's dump folder (its latest "
        "checkpoint), of a checkpoints/step-N folder or of an exported Hugging Face folder, as "
        "the downstream_eval plugin does during training. Under torchrun the items are split "
        "over the processes. Prints a table; -o writes the scores as JSON, --log-samples each "
        "item's per-choice log-likelihoods as JSONL (the records of lm-eval's --log_samples).",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--tasks", nargs="+", required=True, metavar="FILE",
        help="task files (sample:cloze.jsonl: the shipped Shakespeare cloze)",
    )  # fmt: skip
    parser.add_argument("-o", "--output", help="write the scores to this JSON file")
    parser.add_argument(
        "--log-samples",
        metavar="FILE",
        help="write each item's per-choice log-likelihoods to this JSONL file (lm-eval's shape)",
    )
    parser.add_argument(
        "--max-items", type=int, default=0, help="items per task, evenly spaced (0: all)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="sequences per forward (default 32)"
    )
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: a GPU if any"
    )


def run(args: argparse.Namespace) -> int:
    """``plugtrain eval``: score ``args.tasks`` on the model at ``args.path``."""
    if args.max_items < 0:
        raise ConfigError(f"--max-items must be >= 0 (0: all), got {args.max_items}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    for option, path in (("-o", args.output), ("--log-samples", args.log_samples)):
        if path and not Path(path).parent.is_dir():
            raise ConfigError(
                f"{option} '{path}': folder '{Path(path).parent}' does not exist: create it, "
                "or give another path"
            )
    tasks = [read_task(path) for path in args.tasks]  # bad input stops here, before the model
    names = [task.name for task in tasks]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--tasks names two files called '{name}': rename one")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(args.device, local_rank)
    rank, world_size = 0, 1
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        model, tokenizer = load(args.path, device, args.weights, args.tokenizer)
        encoded = encode_tasks(tasks, tokenizer, model.args.max_seq_len, args.max_items)
        scores, items = score_items(
            model, encoded, batch_size=args.batch_size, rank=rank, world_size=world_size
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return 0
    table = results(scores, list(args.tasks))
    print(f"{'task':<16} {'items':>6} {'acc':>7} {'acc 95%':>15} {'acc_norm':>9}")
    for name, r in table.items():
        interval = "{:.4f}-{:.4f}".format(*r["acc_95"])
        print(f"{name:<16} {r['items']:>6} {r['acc']:>7.4f} {interval:>15} {r['acc_norm']:>9.4f}")
    if args.output:
        record = {"model": str(args.path), "weights": args.weights, "tasks": table}
        Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.output}")
    if args.log_samples:
        lines = (json.dumps(r, ensure_ascii=False) + "\n" for r in sample_records(tasks, items))
        Path(args.log_samples).write_text("".join(lines))
        print(f"wrote {args.log_samples}: {len(items)} items, each choice's log-likelihood")
    return 0
