"""Context parallelism: the zigzag parts of a row, and training runs of CP 2 (all-gather and
Ulysses) on 2 processes and CP 2 x FSDP 2 on 4 against one process over 6 steps at seq_len 256
(fp32, grad_clip on): causal on text, document masking and the assistant's loss on chat data,
chat data whose counted tokens land mostly on one rank, the loss in chunks; a CP 2 checkpoint
resumed on one process; the activations a rank holds at seq_len 2048; the refusals.

The runs are shared through a module-scoped fixture: one launch of 2 processes, one of 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugtrain.config import JobConfig, ParallelismConfig
from plugtrain.data import IGNORE_INDEX, MicroBatch
from plugtrain.distributed import ParallelDims, parallel_dims
from plugtrain.errors import ConfigError
from plugtrain.model import LLAMA, MOE
from plugtrain.model.context_parallel import causal_by_blocks, causal_by_padding, zigzag_indices
from plugtrain.testing import (
    CHAT,
    GradNorms,
    copy_checkpoint,
    make_trainer,
    metrics_by_step,
    relative,
    run_distributed,
    saved_activation_bytes,
)
from plugtrain.training import estimate_run
from plugtrain.training.layout import context_parallel
from plugtrain.training.step import context_part

STEPS, SAVED, SEQ = 6, 3, 256
RUN = (
    "--model.flavor", "tiny4",
    "--training.seq_len", str(SEQ),
    "--training.batch_size", "4",
    "--training.grad_accum_steps", "2",
    "--plugins.enabled", "grad_clip",
    "--grad_clip.max_norm", "0.8",
    "--validation.interval", str(STEPS),
    "--validation.steps", "1",
)  # fmt: skip
SAVE = ("--checkpoint.enable", "true", "--checkpoint.interval", str(SAVED))
FP16 = (
    "--training.mixed_precision_param", "float16",
    "--plugins.enabled", "grad_clip,grad_scaler",
)  # fmt: skip
"""float16 compute, the loss scaled by grad_scaler and the gradients clipped."""
TOLERANCE = 1e-5
FP16_TOLERANCE = 1e-4
"""Relative, in float16; measured: losses 1.5e-6, grad norms 3.9e-5 (each part's attention and
its reductions round in float16 otherwise than the whole row's)."""
"""Relative, on the losses, validation loss and grad norms, as the issue asks; measured:
losses 1.2e-7, grad norms 8.5e-6 (the fp32 norm kernel's rounding over other partial sums)."""


def prompts_file(folder: Path) -> Path:
    """Chat data whose conversations are a long question and a short answer: one per row at
    seq_len 256, their counted tokens (the answers) at the rows' ends, on one rank's part."""
    path = folder / "long_prompts.jsonl"
    lines = []
    for i in range(24):
        question = " ".join(f"word{(i * 7 + j) % 50}" for j in range(80))
        answer = f"The answer is {i}."
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def train(folder: Path, *args: str) -> dict[int, float]:
    """Train a run of ``RUN`` + ``args``; this rank's grad norms by step."""
    log = GradNorms()
    trainer = make_trainer(folder, *RUN, *args, steps=STEPS, plugins=[("norm_log", log)])
    log.watch(trainer)
    trainer.run()
    return log.norms


def data_of(base: Path, kind: str) -> tuple[str, ...]:
    if kind == "text":
        return ()
    if kind == "chat":
        return CHAT
    prompts = str(base / "long_prompts.jsonl")
    return ("--data.train_path", prompts, "--data.validation_path", prompts)


LAYOUTS = {
    "cp2": ("--parallelism.cp", "2"),
    "cp2_ulysses": ("--parallelism.cp", "2", "--parallelism.cp_method", "ulysses"),
}
KINDS = ("text", "chat", "prompts")


def two_ranks(base: str) -> dict:
    root, norms = Path(base), {}
    for layout, args in LAYOUTS.items():
        for kind in KINDS:
            norms[f"{kind}_{layout}"] = train(
                root / f"{kind}_{layout}", *args, *data_of(root, kind)
            )
    chunks = ("--model.loss_chunks", "4")
    norms["chunks_cp2"] = train(root / "chunks_cp2", *LAYOUTS["cp2"], *CHAT, *chunks)
    norms["saved_cp2"] = train(root / "saved_cp2", *LAYOUTS["cp2"], *SAVE)
    norms["memory"] = activation_bytes(root / "memory_cp2", *LAYOUTS["cp2"])
    norms["fp16_cp2"] = train(root / "fp16_cp2", *LAYOUTS["cp2"], *FP16)
    return norms


def four_ranks(base: str) -> dict:
    root = Path(base)
    return {
        f"{kind}_cp2xfsdp2": train(
            root / f"{kind}_cp2xfsdp2", *LAYOUTS["cp2"], *data_of(root, kind)
        )
        for kind in ("text", "chat")
    }


def resume(written: Path, resumed: Path) -> dict[int, float]:
    """Resume run ``written``'s step-``SAVED`` checkpoint in ``resumed``, on one process."""
    copy_checkpoint(written, resumed, SAVED)
    return train(resumed, *SAVE)


def activation_bytes(folder: Path, *args: str) -> int:
    """The bytes one training forward at seq_len 2048 keeps for its backward on this rank."""
    long = ("--training.seq_len", "2048", "--training.batch_size", "1")
    long += ("--training.grad_accum_steps", "1")
    trainer = make_trainer(folder, *RUN, *long, *args, steps=1)
    saved = saved_activation_bytes(trainer, trainer.batches.next_batch()[0])
    trainer.abort()
    return saved


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("cp")
    prompts_file(base)
    norms = {f"{kind}_one": train(base / f"{kind}_one", *data_of(base, kind)) for kind in KINDS}
    norms["chunks_one"] = train(base / "chunks_one", *CHAT, "--model.loss_chunks", "4")
    norms["saved_one"] = train(base / "saved_one", *SAVE)
    norms["fp16_one"] = train(base / "fp16_one", *FP16)
    ranks = {
        "two": run_distributed(two_ranks, 2, str(base)),
        "four": run_distributed(four_ranks, 4, str(base)),
    }
    for launch in ranks.values():
        for name in launch[0]:
            if name == "memory":  # the larger rank's
                norms[name] = max(rank[name] for rank in launch)
                continue
            assert all(rank[name] == launch[0][name] for rank in launch), name  # every rank
            norms[name] = launch[0][name]
    norms["saved_cp2_to_one"] = resume(base / "saved_cp2", base / "saved_cp2_to_one")
    norms["memory_one"] = activation_bytes(base / "memory_one")
    return {"base": base, "norms": norms}


def assert_as_one_process(runs: dict, run: str, one: str, steps: range) -> None:
    base, norms = runs["base"], runs["norms"]
    ours, theirs = metrics_by_step(base / run), metrics_by_step(base / one)
    for step in steps:
        for key in ("loss", "validation_loss", "grad_clip/grad_norm"):
            if key in theirs[step]:
                assert relative(ours[step][key], theirs[step][key]) < TOLERANCE, (run, step, key)
        assert relative(norms[run][step], norms[one][step]) < TOLERANCE, (run, step)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "kind"),
    [(layout, kind) for layout in LAYOUTS for kind in KINDS]
    + [("cp2xfsdp2", "text"), ("cp2xfsdp2", "chat")],
)
def test_context_parallel_runs_train_as_one_process(runs, layout, kind):
    assert_as_one_process(runs, f"{kind}_{layout}", f"{kind}_one", range(1, STEPS + 1))


@pytest.mark.slow
def test_float16_with_the_loss_scaler_trains_as_one_process(runs):
    """grad_scaler and grad_clip in float16 under CP 2: one process's losses, norms and loss
    scale within float16's rounding (the parts' attention rounds otherwise)."""
    base, norms = runs["base"], runs["norms"]
    ours, theirs = metrics_by_step(base / "fp16_cp2"), metrics_by_step(base / "fp16_one")
    for step in range(1, STEPS + 1):
        assert ours[step]["grad_scaler/loss_scale"] == theirs[step]["grad_scaler/loss_scale"]
        assert relative(ours[step]["loss"], theirs[step]["loss"]) < FP16_TOLERANCE, step
        assert relative(norms["fp16_cp2"][step], norms["fp16_one"][step]) < FP16_TOLERANCE


@pytest.mark.slow
def test_the_loss_in_chunks_and_a_resume_on_one_process(runs):
    assert_as_one_process(runs, "chunks_cp2", "chunks_one", range(1, STEPS + 1))
    resumed = "saved_cp2_to_one"
    assert min(metrics_by_step(runs["base"] / resumed)) == SAVED + 1
    assert_as_one_process(runs, resumed, "saved_one", range(SAVED + 1, STEPS + 1))


@pytest.mark.slow
def test_a_rank_holds_about_half_the_activations_at_cp2(runs):
    norms = runs["norms"]
    assert norms["memory"] <= 0.6 * norms["memory_one"], (norms["memory"], norms["memory_one"])


def test_the_prompts_data_puts_the_counted_tokens_mostly_on_one_rank(tmp_path):
    """prime-rl #1957's case: what the loss counts lands unevenly on the ranks; the runs above
    give one process's loss on it all the same."""
    trainer = make_trainer(
        tmp_path / "run", *RUN, *data_of(prompts_file(tmp_path).parent, "prompts")
    )
    rows = trainer.batches.next_batch()[0].targets
    counted = [(rows[:, zigzag_indices(SEQ, 2, rank)] != IGNORE_INDEX).sum() for rank in (0, 1)]
    trainer.abort()
    assert counted[0] >= 4 * counted[1], counted


@pytest.mark.parametrize("attend", [causal_by_blocks, causal_by_padding])
def test_queries_at_the_end_of_their_keys_attend_causally_without_a_mask(attend):
    """A chunk's queries over the keys up to its end (all-gather's): the CPU's blocks merged by
    log-sum-exp, and other devices' padding, against SDPA under the mask, grouped heads."""
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, dtype=torch.float64, generator=generator)
        return t.requires_grad_()

    q, k, v = tensor(2, 4, 8, 8), tensor(2, 2, 24, 8), tensor(2, 2, 24, 8)
    mask = torch.ones(8, 24, dtype=torch.bool).tril(24 - 8)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    grad = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
    out = attend(q, k, v)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-14)
    for ours, theirs in zip(
        torch.autograd.grad(out, (q, k, v), grad),
        torch.autograd.grad(reference, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-14)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_zigzag_parts_cover_each_row_once_balanced(cp):
    parts = [zigzag_indices(16, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(16))
    chunk = 16 // (2 * cp)
    assert parts[0].tolist() == [*range(chunk), *range(16 - chunk, 16)]
    # Causal work (each query's keys before it) is the same on every rank.
    assert len({int((part + 1).sum()) for part in parts}) == 1


def test_the_cp_ranks_share_rows_and_fsdp_spans_them():
    dims = [parallel_dims(ParallelismConfig(cp=2), 4, rank=rank) for rank in range(4)]
    assert [(d.dp_rank, d.rank_in("cp")) for d in dims] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(d.dp_size, d.dp_shard, d.cp) for d in dims} == {(2, 2, 2)}


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        (
            {"cp": 2, "tp": 2},
            "parallelism.cp = 2 with tp = 2: context parallelism does not compose with tp yet; "
            "set parallelism.tp = 1, or cp = 1",
        ),
        (
            {"cp": 3},
            "parallelism.cp = 3 does not divide the world size 4: launch a multiple of 3 "
            "processes, or set cp to a divisor of 4",
        ),
    ],
)
def test_degrees_cp_cannot_take_are_refused_in_one_line(degrees, message):
    with pytest.raises(ConfigError) as refused:
        parallel_dims(ParallelismConfig(**degrees), 4)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("keys", "spec", "message"),
    [
        (
            {"training.seq_len": 100},
            LLAMA,
            "training.seq_len = 100 does not divide into 2 x cp = 8 chunks (each rank holds one "
            "from each end of a row): choose a seq_len that 8 divides",
        ),
        (
            {"parallelism.cp_method": "ulysses", "model.flavor": "tiny"},
            LLAMA,
            "parallelism.cp_method = 'ulysses' splits the heads over cp = 4 ranks, but "
            "model.n_kv_heads = 2 does not divide by 4: use cp_method = 'allgather', or a cp "
            "that divides the key/value heads",
        ),
        (
            {"model.family": "moe"},
            MOE,
            "model.family = 'moe' does not run under context parallelism yet "
            "(parallelism.cp = 4): set parallelism.cp = 1",
        ),
    ],
)
def test_what_cp_cannot_split_is_refused_in_one_line(keys, spec, message):
    config = JobConfig()
    config.training.seq_len = 128
    for key, value in keys.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    with pytest.raises(ConfigError) as refused:
        context_parallel(config, ParallelDims(cp=4), spec)
    assert str(refused.value) == message


def test_a_microbatch_part_keeps_each_tokens_place():
    rows = torch.arange(16).view(2, 8)
    microbatch = MicroBatch(rows, rows + 100, documents=rows // 3)

    part = context_part(microbatch, 2, 1)
    assert part.inputs.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part.targets.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert part.positions.tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]  # RoPE: their places
    assert part.documents.tolist() == [[0, 1, 1, 1], [3, 3, 4, 4]]


def test_the_estimate_gives_a_rank_the_activations_of_its_part_of_a_row():
    def estimate(cp: int, seq_len: int, world: int):
        config = JobConfig()
        config.parallelism.cp = cp
        config.training.seq_len, config.training.batch_size = seq_len, 2
        return estimate_run(config, world)

    split, short = estimate(cp=2, seq_len=1024, world=4), estimate(cp=1, seq_len=512, world=2)
    sizes = [{name: size for name, size, _ in e.parts} for e in (split, short)]
    assert sizes[0]["activations"] == sizes[1]["activations"] > 0
    assert sizes[0]["logits"] == sizes[1]["logits"] > 0
    # The model is sharded over dp_shard x cp: all four ranks.
    assert sizes[0]["parameters"] * 2 == sizes[1]["parameters"]
