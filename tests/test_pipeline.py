"""Pipeline parallelism in training runs: PP 2 with 1F1B, Interleaved1F1B and ZBVZeroBubble on
2 processes, PP 2 x FSDP 2 and PP 2 x TP 2 on 4, against one process over 8 steps (fp32,
grad_clip on, 4 microbatches), on text and on chat data (document masking, the assistant's
tokens only); no trainable parameter left without a gradient; a PP 2 checkpoint's keys, its
export to Hugging Face, and its resume on one process, at PP 2 x FSDP 2 and at TP 2; fp16 with
an inf on one stage only; the refusals.

The runs are shared through a module-scoped fixture: one launch of 2 processes, one of 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from plugtrain.checkpoint.export import export_checkpoint
from plugtrain.config import JobConfig, ParallelismConfig
from plugtrain.distributed import ParallelDims
from plugtrain.errors import ConfigError
from plugtrain.model import LLAMA, MOE
from plugtrain.plugin import hookimpl
from plugtrain.testing import (
    CHAT,
    GradNorms,
    InjectInf,
    copy_checkpoint,
    make_trainer,
    metrics_by_step,
    relative,
    run_distributed,
)
from plugtrain.training.pipeline import pipeline_placement

STEPS, SAVED = 8, 4
RUN = (
    "--model.flavor", "tiny4",
    "--training.batch_size", "8",
    "--training.grad_accum_steps", "4",
    "--plugins.enabled", "grad_clip",
    "--grad_clip.max_norm", "0.45",
    "--validation.interval", str(STEPS),
    "--validation.steps", "2",
)  # fmt: skip
"""Four microbatches of two rows; the clip bites at some steps (the norms are 0.43-0.49)."""
SAVE = ("--checkpoint.enable", "true", "--checkpoint.interval", str(SAVED))
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
TOLERANCE = 1e-5
"""Relative, on the losses and grad norms, as the issue asks; measured: losses 1.3e-7, grad
norms 8.1e-6 (torch's fp32 norm kernel on CPU sums other partial sums over the stages' and
shards' gradients: tests/test_expert_parallel_runs.py's NORM_TOLERANCE says how much)."""


class StepLog(GradNorms):
    """Keeps each step's pre-clip grad norm, as this rank computed it, and the names of the
    trainable parameters left without a gradient after the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.no_grad: dict[int, list[str]] = {}
        self.names: dict[int, str] = {}

    @hookimpl
    def pre_step(self, ctx) -> None:
        self.no_grad[ctx.step] = [self.names[id(p)] for p in ctx.params if p.grad is None]


def train(folder: Path, *args: str) -> dict:
    """Train a run of ``RUN`` + ``args``: this rank's grad norms and gradient-less parameters
    by step, and how many parameters it trains."""
    log = StepLog()
    trainer = make_trainer(folder, *RUN, *args, steps=STEPS, plugins=[("step_log", log)])
    log.watch(trainer)
    log.names = {id(p): name for name, p in trainer.model.named_parameters()}
    trainer.run()
    return {"norms": log.norms, "no_grad": log.no_grad, "params": len(trainer.params)}


def resume(written: Path, resumed: Path, *args: str) -> dict:
    """Resume run ``written``'s step-``SAVED`` checkpoint (its later one left behind) in the
    new dump folder ``resumed``."""
    copy_checkpoint(written, resumed, SAVED)
    return train(resumed, *SAVE, *args)


def two_ranks(base: str) -> dict:
    root = Path(base)
    runs = {}
    for schedule in SCHEDULES:
        pp = ("--parallelism.pp", "2", "--parallelism.pp_schedule", schedule)
        runs[schedule] = train(root / schedule, *pp, *(SAVE if schedule == "1F1B" else ()))
        runs[f"chat_{schedule}"] = train(root / f"chat_{schedule}", *pp, *CHAT)
    return runs


def four_ranks(base: str) -> dict:
    root, pp, tp = Path(base), ("--parallelism.pp", "2"), ("--parallelism.tp", "2")
    return {
        "pp2xfsdp2": train(root / "pp2xfsdp2", *pp),
        "chat_pp2xfsdp2": train(root / "chat_pp2xfsdp2", *pp, *CHAT),
        "pp2xtp2": train(root / "pp2xtp2", *pp, *tp),
        "chat_pp2xtp2": train(root / "chat_pp2xtp2", *pp, *tp, *CHAT),
        "pp2xhsdp2": train(root / "pp2xhsdp2", *pp, "--parallelism.dp_replicate", "2"),
        "1F1B_to_pp2xfsdp2": resume(root / "1F1B", root / "1F1B_to_pp2xfsdp2", *pp),
        "1F1B_to_tp2": resume(root / "1F1B", root / "1F1B_to_tp2", *tp),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("pp")
    ranks = {"one": [train(base / "one", *SAVE)], "chat_one": [train(base / "chat_one", *CHAT)]}
    for layouts in (
        run_distributed(two_ranks, 2, str(base)),
        run_distributed(four_ranks, 4, str(base)),
    ):
        for layout in layouts[0]:
            ranks[layout] = [rank[layout] for rank in layouts]
    ranks["1F1B_to_one"] = [resume(base / "1F1B", base / "1F1B_to_one")]
    return {"base": base, "ranks": ranks}


def global_norms(ranks: list[dict]) -> dict[int, float]:
    """The run's grad norms by step, checked the same on every rank."""
    assert all(rank["norms"] == ranks[0]["norms"] for rank in ranks)
    return ranks[0]["norms"]


def assert_as_one_process(runs: dict, layout: str, one: str, steps: range) -> None:
    """``layout``'s losses, validation loss and grad norms are ``one``'s within TOLERANCE."""
    base, ranks = runs["base"], runs["ranks"]
    ours, theirs = metrics_by_step(base / layout), metrics_by_step(base / one)
    for step in steps:
        for key in ("loss", "validation_loss", "grad_clip/grad_norm"):
            if key in theirs[step]:
                assert relative(ours[step][key], theirs[step][key]) < TOLERANCE, (step, key)
    norms, reference = global_norms(ranks[layout]), global_norms(ranks[one])
    assert all(relative(norms[s], reference[s]) < TOLERANCE for s in steps)
    # Every trainable parameter got its gradient on its stage, whatever the schedule.
    assert all(not any(rank["no_grad"].values()) for rank in ranks[layout])


@pytest.mark.slow
@pytest.mark.parametrize("data", ["", "chat_"])
@pytest.mark.parametrize("layout", [*SCHEDULES, "pp2xfsdp2", "pp2xtp2"])
def test_pipelines_train_as_one_process(runs, layout, data):
    assert_as_one_process(runs, data + layout, data + "one", range(1, STEPS + 1))
    # Each rank trains only its stages' parameters, and together all of them.
    ranks, whole = runs["ranks"][data + layout], runs["ranks"]["one"][0]["params"]
    assert all(rank["params"] < whole for rank in ranks)


@pytest.mark.slow
def test_a_pipeline_of_hybrid_sharded_stages_trains_as_one_process(runs):
    """PP 2 x HSDP (2 replicas of 1 shard): the gradients all-reduced across the replicas once
    per step, by the schedule's last backward."""
    assert_as_one_process(runs, "pp2xhsdp2", "one", range(1, STEPS + 1))


@pytest.mark.slow
def test_a_pp2_checkpoint_has_one_process_keys_and_resumes_in_other_layouts(runs):
    base = runs["base"]

    def keys(run: str) -> set[str]:
        reader = dcp.FileSystemReader(str(base / run / f"checkpoints/step-{SAVED}"))
        saved = reader.read_metadata().state_dict_metadata
        return {k for k in saved if k.startswith(("model.", "optimizer."))}

    assert keys("1F1B") == keys("one")
    # export-hf reads a PP 2 checkpoint as a 1-process one: the same tensors, within rounding.
    exported = {}
    for run in ("1F1B", "one"):
        export_checkpoint(base / run / f"checkpoints/step-{SAVED}", base / f"hf_{run}")
        files = sorted((base / f"hf_{run}").glob("*.safetensors"))
        exported[run] = {k: v for f in files for k, v in load_file(f).items()}
    assert exported["1F1B"].keys() == exported["one"].keys()
    for name, tensor in exported["one"].items():
        torch.testing.assert_close(exported["1F1B"][name], tensor, rtol=0, atol=TOLERANCE)
    for resumed in ("1F1B_to_one", "1F1B_to_pp2xfsdp2", "1F1B_to_tp2"):
        assert min(metrics_by_step(base / resumed)) == SAVED + 1
        # The uninterrupted one-process run's losses and norms, from the PP 2 checkpoint.
        assert_as_one_process(runs, resumed, "one", range(SAVED + 1, STEPS + 1))


def fp16_inf(base: str) -> dict:
    args = (
        "--model.flavor", "tiny4", "--training.grad_accum_steps", "2",
        "--training.mixed_precision_param", "float16",
        "--plugins.enabled", "grad_scaler,grad_clip", "--parallelism.pp", "2",
    )  # fmt: skip
    # Rank 1 holds the last stage alone (PP 2 on 2 processes).
    plugins = [("inject", InjectInf(steps=[2], ranks=[1])), ("grad_scaler", None)]
    trainer = make_trainer(Path(base), *args, steps=3, plugins=plugins)
    scaler = trainer.host.get("grad_scaler")
    trainer.run()
    return {"skipped": int(trainer.vetoes.total), "scale": float(scaler.scale)}


@pytest.mark.slow
def test_an_inf_on_one_stage_skips_the_step_on_every_rank(tmp_path):
    ranks = run_distributed(fp16_inf, 2, str(tmp_path))
    assert ranks[0] == ranks[1] and ranks[0]["skipped"] == 1
    assert ranks[0]["scale"] == 2.0**16 / 2  # backed off once, on both stages
    records = metrics_by_step(tmp_path)
    assert records[2]["skipped_steps"] == 1 and records[1]["skipped_steps"] == 0


def dims_of(pp: int, rank: int) -> ParallelDims:
    return ParallelDims(pp=pp, rank=rank)


@pytest.mark.parametrize(
    ("schedule", "placements"),
    [
        ("1F1B", [(2, (0,)), (2, (1,))]),
        ("Interleaved1F1B", [(4, (0, 2)), (4, (1, 3))]),
        ("ZBVZeroBubble", [(4, (0, 3)), (4, (1, 2))]),
    ],
)
def test_each_rank_holds_its_schedules_stages(schedule, placements):
    config = JobConfig()
    config.parallelism = ParallelismConfig(pp=2, pp_schedule=schedule)
    config.training.grad_accum_steps = 4
    got = [pipeline_placement(config, dims_of(2, rank), LLAMA) for rank in (0, 1)]
    assert got == placements
    assert pipeline_placement(JobConfig(), ParallelDims(), LLAMA) is None


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            ("model", "loss_chunks", 2),
            "model.loss_chunks > 1 does not run under pipeline parallelism yet "
            "(parallelism.pp = 2): set parallelism.pp = 1, or change model.loss_chunks",
        ),
        (
            ("training", "grad_accum_steps", 1),
            "training.grad_accum_steps = 1 microbatches are fewer than 1F1B needs on 2 pipeline "
            "ranks (2 stages): set grad_accum_steps to 2 or more",
        ),
        (
            ("model", "family", "moe"),
            "model.family = 'moe' does not run under pipeline parallelism yet "
            "(parallelism.pp = 2): set parallelism.pp = 1, or change model.family",
        ),
    ],
)
def test_what_a_pipeline_cannot_run_yet_is_refused_in_one_line(setting, message):
    config = JobConfig()
    section, key, value = setting
    setattr(getattr(config, section), key, value)
    spec = MOE if value == "moe" else LLAMA
    with pytest.raises(ConfigError) as refused:
        pipeline_placement(config, dims_of(2, 0), spec)
    assert str(refused.value) == message
