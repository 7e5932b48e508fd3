"""Tensor parallelism and what runs beside the training step: the collectives of a TP 2 step
against an FSDP 2 one, counted with the cost counter; samples and downstream_eval under TP 2
against 1 process on the same weights; ``plugtrain generate`` and ``eval`` on a TP checkpoint.

The multi-process checks share one 2-process launch through a module-scoped fixture.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from plugtrain_downstream_eval import DownstreamEval
from plugtrain_samples import Samples

from plugtrain.cli import main
from plugtrain.commands.generate import load
from plugtrain.errors import UserError
from plugtrain.evaluation import encode_tasks, loglikelihoods, read_task, score
from plugtrain.model import FLAVORS, complete, generate
from plugtrain.plugin import ValidationContext, hookimpl
from plugtrain.testing import (
    SAMPLE,
    Costs,
    count_costs,
    make_trainer,
    metrics_by_step,
    run_distributed,
)

FP32 = ("--training.mixed_precision_param", "float32")
TP2 = ("--parallelism.tp", "2")
LAYERS = FLAVORS["tiny"].n_layers  # 2
NORMS = 2 * LAYERS + 1  # attention_norm and ffn_norm in each block, and the final norm

# Per non-logging step on 2 processes, from the tiny model's shapes; every case also makes the
# stop vote, one asynchronous all-reduce on a gloo group ("c10d.allreduce_").
COLLECTIVES = {
    "fsdp2": {
        # Forward gathers the root (embedding, final norm, output) and each block; backward
        # gathers again every block but the last, which stays gathered after forward.
        "c10d._allgather_base_": (LAYERS + 1) + (LAYERS - 1),
        # Each FSDP unit's gradients: one reduce-scatter per block and one for the root.
        "c10d._reduce_scatter_base_": LAYERS + 1,
        "c10d.allreduce_": 1,
    },
    "tp2": {
        # Sequence parallelism: in each block the positions are gathered before the attention
        # and before the FFN, and the row-wise wo and w2 reduce-scatter their sums by position:
        # 2 of each in forward, and each one's transpose in backward; the embedding's
        # reduce-scatter and the output projection's gather add one of each, with backward's.
        "_c10d_functional.all_gather_into_tensor": 4 * LAYERS + 2,
        "_c10d_functional.reduce_scatter_tensor": 4 * LAYERS + 2,
        # loss_parallel's cross-entropy of the vocabulary-sharded logits (the max, the sum of
        # the exponentials, the target's logit), and the gradient of each TP-replicated norm
        # weight, partial over the positions each rank normalised.
        "_c10d_functional.all_reduce": 3 + NORMS,
        "c10d.allreduce_": 1,
    },
}
LAYOUTS = {"fsdp2": FP32, "tp2": (*FP32, *TP2)}


STEPS = 2
PROMPTS = ["ROMEO:", "The king"]
NEW_TOKENS = 13
TASKS = [str(SAMPLE / "cloze.jsonl")]
ITEMS = 24
VALIDATED = (
    *FP32, *TP2,
    "--plugins.enabled", "samples,downstream_eval",
    "--samples.prompts", json.dumps(PROMPTS),
    "--samples.max_new_tokens", str(NEW_TOKENS),
    "--downstream_eval.tasks", json.dumps(TASKS),
    "--downstream_eval.max_items", str(ITEMS),
    "--downstream_eval.batch_size", "7",  # padded widths of both parities
    "--validation.interval", str(STEPS),
    "--validation.steps", "1",
    "--data.validation_path", str(SAMPLE / "validation.jsonl"),
    "--checkpoint.enable", "true",
    "--checkpoint.interval", str(STEPS),
    "--optimizer.lr", "0.01",
)  # fmt: skip
"""TP 2 with samples (greedy) and downstream_eval at step ``STEPS``, checkpointed there."""
LOGLIKELIHOOD_TOLERANCE = 1e-4
"""TP 2 against 1 process on the same weights, fp32 (measured: 1.5e-5)."""


def recording(plugin_class: type) -> object:
    """An instance of plugin ``plugin_class`` that also keeps what its ``validation_metrics``
    returned, by step (``returned``)."""

    class Recording(plugin_class):
        def __init__(self) -> None:
            super().__init__()
            self.returned: dict[int, dict] = {}

        @hookimpl
        def validation_metrics(self, ctx: ValidationContext) -> dict | None:
            metrics = super().validation_metrics(ctx)
            self.returned[ctx.step] = metrics
            return metrics

    return Recording()


def validated(folder: Path) -> dict:
    """Train ``VALIDATED``; what samples and downstream_eval returned on this rank, and this
    rank's own decoding (sampled) and log-likelihoods on the trained model."""
    samples, downstream = recording(Samples), recording(DownstreamEval)
    plugins = [("samples", samples), ("downstream_eval", downstream)]
    trainer = make_trainer(folder, *VALIDATED, steps=STEPS, plugins=plugins)
    trainer.run()
    encoded = encode_tasks(
        [read_task(t) for t in TASKS], trainer.tokenizer, trainer.model_args.max_seq_len, ITEMS
    )
    sampled = complete(
        trainer.model, trainer.tokenizer, PROMPTS[0], NEW_TOKENS, temperature=1.0, seed=3
    )
    too_long = None
    try:  # the longest generation 1 process can make: TP's padding leaves no room for it
        whole = trainer.model_args.max_seq_len - 1
        generate(trainer.model, torch.zeros(1, 1, dtype=torch.long), whole)
    except UserError as e:
        too_long = str(e)
    return {
        "too_long": too_long,
        "samples": samples.returned[STEPS],
        "downstream_eval": downstream.returned[STEPS],
        "sampled": sampled,
        "loglikelihoods": loglikelihoods(trainer.model, encoded, batch_size=7),
    }


def on_each_rank(base: str) -> dict:
    """On each of 2 ranks: the costs per non-logging step of FSDP 2 and of TP 2; a TP 2 run
    with samples and downstream_eval."""
    root = Path(base)
    return {
        "costs": {
            name: count_costs(root / name, *args, short=2, long=3) for name, args in LAYOUTS.items()
        },
        "validated": validated(root / "validated"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tp_plugins")
    ranks = run_distributed(on_each_rank, 2, str(base))
    return {"base": base, "ranks": ranks, "metrics": metrics_by_step(base / "validated")[STEPS]}


@pytest.fixture(scope="module")
def one_process(runs) -> dict:
    """What 1 process computes on the weights of the TP 2 run's checkpoint."""
    checkpoint = runs["base"] / "validated" / "checkpoints" / f"step-{STEPS}"
    model, tokenizer = load(checkpoint)
    encoded = encode_tasks([read_task(t) for t in TASKS], tokenizer, model.args.max_seq_len, ITEMS)
    return {
        "checkpoint": checkpoint,
        "samples": {
            str(i): complete(model, tokenizer, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)
        },
        "sampled": complete(model, tokenizer, PROMPTS[0], NEW_TOKENS, temperature=1.0, seed=3),
        "scores": score(model, encoded, batch_size=7),
        "loglikelihoods": loglikelihoods(model, encoded, batch_size=7),
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", COLLECTIVES)
def test_the_collectives_of_a_step_are_those_the_layout_makes(runs, layout):
    for rank, result in enumerate(runs["ranks"]):
        costs: Costs = result["costs"][layout]
        assert costs.syncs == 0, (rank, costs.sync_sites)
        assert costs.collectives == COLLECTIVES[layout], (rank, costs.collectives)


@pytest.mark.slow
def test_samples_under_tensor_parallelism_write_what_one_process_writes(runs, one_process):
    for rank, result in enumerate(runs["ranks"]):
        texts = result["validated"]["samples"]
        assert texts == one_process["samples"], rank  # greedy
        assert result["validated"]["sampled"] == one_process["sampled"], rank  # the same draws
    logged = {
        key.removeprefix("samples/"): v
        for key, v in runs["metrics"].items()
        if key.startswith("samples/")
    }
    assert logged == one_process["samples"]
    assert all(logged.values())


@pytest.mark.slow
def test_downstream_scores_under_tensor_parallelism_are_one_process_scores(runs, one_process):
    ((name, expected),) = one_process["scores"].items()
    assert expected.items == ITEMS
    for rank, result in enumerate(runs["ranks"]):
        scores = result["validated"]["downstream_eval"]
        assert scores == {f"{name}/acc": expected.acc, f"{name}/acc_norm": expected.acc_norm}, rank
        tp = result["validated"]["loglikelihoods"]
        difference = max(abs(a - b) for a, b in zip(tp, one_process["loglikelihoods"], strict=True))
        print(f"rank {rank}: log-likelihoods, max difference {difference:.3g}")
        assert difference < LOGLIKELIHOOD_TOLERANCE, (rank, difference)
    assert runs["metrics"][f"downstream_eval/{name}/acc"] == expected.acc


@pytest.mark.slow
def test_a_generation_that_leaves_no_room_for_the_padding_is_refused_in_one_line(runs):
    for result in runs["ranks"]:
        assert result["validated"]["too_long"] == (
            "a prompt of 1 tokens plus 63 new tokens does not fit the model's max_seq_len 64 "
            "(less 1 for tensor parallelism's padding): give a prompt of 1 to 62 tokens and "
            "fewer new tokens"
        )


def cli(*argv: str) -> str:
    """What ``plugtrain`` prints for ``argv``; fails unless it exits 0."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(list(argv)) == 0
    return out.getvalue()


@pytest.mark.slow
def test_generate_and_eval_read_a_tensor_parallel_checkpoint_whole(runs, one_process, tmp_path):
    checkpoint = str(one_process["checkpoint"])
    for i, prompt in enumerate(PROMPTS):
        printed = cli(
            "generate",
            checkpoint,
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--device",
            "cpu",
        )
        assert printed.removesuffix("\n") == one_process["samples"][str(i)]
    out = tmp_path / "scores.json"
    cli(
        "eval",
        checkpoint,
        "--tasks",
        *TASKS,
        "--max-items",
        str(ITEMS),
        "--device",
        "cpu",
        "-o",
        str(out),
    )
    (written,) = json.loads(out.read_text())["tasks"].values()
    (expected,) = one_process["scores"].values()
    assert (written["acc"], written["acc_norm"]) == (expected.acc, expected.acc_norm)
