"""A pipeline's plan and memory estimate: the schedules' bubbles and microbatch rules, each
pipeline rank's share of the model and of the activations, and ``plugtrain estimate`` under pp."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest

from plugtrain.cli import main
from plugtrain.errors import ConfigError
from plugtrain.model.llama.memory import estimate_memory
from plugtrain.model.llama.transformer import FLAVORS
from plugtrain.model.memory import Checkpointing
from plugtrain.training.pipeline_plan import (
    bubble_fraction,
    check_microbatches,
    pipeline_share,
    rank_stages,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEBUG = str(CONFIGS / "debug.toml")


@pytest.mark.parametrize(
    ("schedule", "pp", "per_rank", "microbatches", "bubble"),
    [
        ("GPipe", 8, 1, 16, Fraction(7, 23)),
        ("1F1B", 8, 1, 16, Fraction(7, 23)),
        ("1F1B", 2, 1, 4, Fraction(1, 5)),
        ("Interleaved1F1B", 4, 2, 8, Fraction(3, 19)),
        ("Interleaved1F1B", 7, 2, 14, Fraction(6, 34)),
        ("ZBVZeroBubble", 2, 2, 4, Fraction(0)),
        ("DualPipeV", 4, 2, 8, Fraction(0)),
        ("1F1B", 1, 1, 1, Fraction(0)),
    ],
)
def test_each_schedules_bubble_in_theory(schedule, pp, per_rank, microbatches, bubble):
    assert bubble_fraction(schedule, pp, per_rank, microbatches) == bubble


@pytest.mark.parametrize(
    ("schedule", "pp", "per_rank", "microbatches", "message"),
    [
        (
            "1F1B", 4, 1, 3,
            "training.grad_accum_steps = 3 microbatches are fewer than 1F1B needs on 4 pipeline "
            "ranks (4 stages): set grad_accum_steps to 4 or more",
        ),
        (
            "ZBVZeroBubble", 4, 2, 6,
            "training.grad_accum_steps = 6 microbatches are fewer than ZBVZeroBubble needs on 4 "
            "pipeline ranks (8 stages): set grad_accum_steps to 7 or more",
        ),
        (
            "DualPipeV", 2, 2, 3,
            "training.grad_accum_steps = 3 microbatches are fewer than DualPipeV needs on 2 "
            "pipeline ranks (4 stages): set grad_accum_steps to 4 or more",
        ),
        (
            "Interleaved1F1B", 4, 2, 9,
            "training.grad_accum_steps = 9 is not a multiple of Interleaved1F1B's rounds "
            "max(1, 9 // pp 4) = 2: set grad_accum_steps to a multiple of 4",
        ),
    ],
)  # fmt: skip
def test_too_few_microbatches_are_refused_in_one_line(
    schedule, pp, per_rank, microbatches, message
):
    with pytest.raises(ConfigError) as refused:
        check_microbatches(schedule, pp, per_rank, microbatches)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("schedule", "pp", "per_rank", "microbatches"),
    [("GPipe", 8, 1, 1), ("1F1B", 4, 1, 4), ("Interleaved1F1B", 4, 2, 3),
     ("Interleaved1F1B", 4, 2, 10), ("ZBVZeroBubble", 4, 2, 7), ("DualPipeV", 2, 2, 4)],
)  # fmt: skip
def test_what_torch_runs_is_accepted(schedule, pp, per_rank, microbatches):
    check_microbatches(schedule, pp, per_rank, microbatches)


def test_each_rank_holds_its_stages_and_keeps_its_schedules_microbatches():
    assert [rank_stages("ZBVZeroBubble", 4, 2, r) for r in (0, 3)] == [(0, 7), (3, 4)]
    assert rank_stages("Interleaved1F1B", 4, 3, 1) == (1, 5, 9)
    in_flight = {
        schedule: [pipeline_share(schedule, 4, per_rank, 8, r).in_flight for r in range(4)]
        for schedule, per_rank in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2),
                                   ("ZBVZeroBubble", 2), ("DualPipeV", 2))
    }  # fmt: skip
    assert in_flight == {
        "GPipe": [8, 8, 8, 8],
        "1F1B": [4, 3, 2, 1],
        "Interleaved1F1B": [11, 9, 7, 5],  # chunks of half a stage
        "ZBVZeroBubble": [8, 8, 8, 8],
        "DualPipeV": [10, 10, 10, 10],
    }
    last = pipeline_share("ZBVZeroBubble", 4, 2, 8, 0)
    assert last.first and last.last and last.num_stages == 8
    assert pipeline_share("GPipe", 4, 1, 8, 3).logits_in_flight == 8


def parts(pp: int = 1, rank: int = 0, schedule: str = "1F1B", **run) -> dict[str, int]:
    """Each part of the 8B model's estimate (fp32, one process per pipeline rank)."""
    per_rank = 2 if schedule in ("ZBVZeroBubble", "Interleaved1F1B") else 1
    share = pipeline_share(schedule, pp, per_rank, 8, rank) if pp > 1 else None
    estimate = estimate_memory(
        FLAVORS["8B"],
        **{"world_size": pp, "microbatch": 1, "seq_len": 1024, "param_dtype": "float32",
           "reduce_dtype": "float32", "checkpointing": Checkpointing("full")} | run,
        pipeline=share,
    )  # fmt: skip
    return {name: nbytes for name, nbytes, _ in estimate.parts}


def test_the_pipeline_ranks_hold_the_model_between_them():
    whole = parts()
    ranks = [parts(4, rank) for rank in range(4)]
    for name in ("parameters", "gradients", "optimizer"):
        assert sum(rank[name] for rank in ranks) == whole[name]
    # The embedding on the first, the output on the last: the middle ones hold blocks only.
    assert ranks[1]["parameters"] == ranks[2]["parameters"] < ranks[0]["parameters"]
    assert ranks[0]["parameters"] < ranks[3]["parameters"]  # the output and the final norm
    assert [rank["logits"] for rank in ranks] == [0, 0, 0, whole["logits"]]
    assert all(rank["gathered"] == 0 for rank in ranks)  # one fp32 process a stage: no FSDP


def test_1f1b_keeps_a_whole_models_activations_on_its_first_rank():
    """pp stages' worth of pp - r microbatches on rank r: rank 0 keeps every block's (but the
    final norm's), as one process does for one microbatch."""
    whole, ranks = parts(), [parts(4, rank)["activations"] for rank in range(4)]
    final_norm = 1024 * (4 * 4096 + 4 + 2 * 4 * 4096)
    assert ranks[0] == whole["activations"] - final_norm
    stage = ranks[0] - ranks[1]  # one microbatch's 8 blocks less
    assert ranks[1] - ranks[2] == stage and ranks[3] == ranks[2] - stage + final_norm
    gpipe = parts(4, 3, "GPipe")
    assert gpipe["logits"] == whole["logits"] + 7 * 1024 * 128256 * 4  # 7 log-softmax kept


def test_sharded_stages_are_held_unsharded_over_the_step():
    rank = parts(2, 0, world_size=16, param_dtype="bfloat16")
    held = rank["gathered"] // (2 + 4)  # bf16 parameters and fp32 gradients, whole
    assert rank["parameters"] == 4 * math.ceil(held / 8)  # fp32, over the stage's 8 ranks


def test_plugtrain_estimate_gives_the_largest_rank_and_the_bubble(capsys):
    overrides = ["--parallelism.pp", "2", "--training.grad_accum_steps", "4"]
    assert main(["estimate", DEBUG, "--gpus", "2", *overrides]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(pp 2 x 2 data-parallel" not in out[0] and "pp 2 x 1 data-parallel" in out[0]
    assert out[-2] == (
        "pipeline: 1F1B, 2 ranks x 1 stage(s), 4 microbatches: bubble 1/5 = 20.0% of a step in "
        "theory (plugtrain/training/pipeline_plan.py)"
    )
    totals = out[-1].removeprefix("total per pipeline rank (the largest above): ").split(", ")
    assert [total.split(": ")[0] for total in totals] == ["0", "1"]
    largest = max(totals, key=lambda total: float(total.split()[1]))
    assert out[-3].split()[1] == largest.split()[1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--parallelism.pp", "3"],
            "model.n_layers = 4 does not divide into 3 pipeline stages: choose a number of "
            "stages that divides 4",
        ),
        (
            ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"],
            "training.grad_accum_steps = 1 microbatches are fewer than ZBVZeroBubble needs on 2 "
            "pipeline ranks (4 stages): set grad_accum_steps to 3 or more",
        ),
        (
            [
                "--parallelism.pp",
                "2",
                "--training.grad_accum_steps",
                "2",
                "--model.loss_chunks",
                "2",
            ],
            "model.loss_chunks > 1 does not run under pipeline parallelism yet (parallelism.pp "
            "= 2): set parallelism.pp = 1, or change model.loss_chunks",
        ),
    ],
)
def test_plugtrain_estimate_refuses_what_a_pipelined_run_would(capsys, overrides, message):
    gpus = overrides[1]
    assert main(["estimate", DEBUG, "--gpus", gpus, *overrides]) == 2
    assert capsys.readouterr().err.strip() == f"plugtrain: error: {message}"


def test_the_405b_config_pipelines_its_blocks_evenly_and_fits(capsys):
    assert main(["estimate", str(CONFIGS / "llama3_405b.toml"), "--gpus", "168"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(pp 21 x tp 8 x 1 data-parallel; pipeline rank 0, stages 0, 41)" in out[0]
    assert out[-2].startswith("pipeline: ZBVZeroBubble, 21 ranks x 2 stage(s), 42 microbatches")
    assert "bubble 0 = 0.0%" in out[-2]
    assert float(out[-3].split()[1]) * 2**30 <= 0.9 * 80 * 10**9
