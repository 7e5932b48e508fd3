"""The memory estimate: every shipped config fits its GPUs, and the formulas match measurements."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from plugtrain_activation_checkpointing import ActivationCheckpointing

from plugtrain.cli import main
from plugtrain.model.llama.memory import estimate_memory, layer_bytes_per_token
from plugtrain.model.llama.transformer import FLAVORS, Transformer
from plugtrain.model.memory import Checkpointing
from plugtrain.testing import PeakMemory, make_trainer, model_context
from plugtrain.training.estimate import checkpointing_of, estimate_run
from plugtrain.training.launch import configure

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
LLAMA3_8B = CONFIGS[0].with_name("llama3_8b.toml")
GPU_BYTES = 80 * 10**9
"""An 80 GB GPU. An estimate must leave a tenth of it for what it does not count (the CUDA
context, NCCL's buffers, the allocator's fragmentation)."""


def intended_world_size(config: Path) -> int:
    """The processes the config is written for: its header's ``--nproc_per_node=N`` (times
    ``--nnodes=M``), else 1."""
    text = config.read_text()
    found = re.search(r"--nproc_per_node=(\d+)", text)
    nodes = re.search(r"--nnodes=(\d+)", text)
    return (int(found.group(1)) if found else 1) * (int(nodes.group(1)) if nodes else 1)


def estimate_of(config: Path, *overrides: str, world_size: int | None = None) -> int:
    configured = configure(["--config", str(config), *overrides])
    assert configured is not None
    return estimate_run(configured[0], world_size or intended_world_size(config)).total


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_fits_an_80gb_gpu(config):
    assert estimate_of(config) <= 0.9 * GPU_BYTES


def test_the_8b_config_as_it_was_does_not_fit(tmp_path):
    """8 sequences of 8192 tokens a GPU without checkpointing: the test can fail."""
    old = tmp_path / LLAMA3_8B.name
    text = re.sub(r"\[activation_checkpointing\][^[]*", "", LLAMA3_8B.read_text())
    old.write_text(text.replace('"activation_checkpointing", ', ""))
    assert estimate_of(old, "--training.grad_accum_steps", "1") > 4 * GPU_BYTES
    assert intended_world_size(LLAMA3_8B) == 8


def test_the_parts_follow_the_sharding_and_the_microbatch():
    args = FLAVORS["8B"]
    run = dict(microbatch=1, seq_len=8192, param_dtype="bfloat16", reduce_dtype="float32")

    def parts(world_size: int, mode: str = "op", **change) -> dict[str, int]:
        estimate = estimate_memory(
            args, world_size=world_size, checkpointing=Checkpointing(mode), **(run | change)
        )
        return {name: nbytes for name, nbytes, _ in estimate.parts}

    one, eight = parts(1), parts(8)
    assert one["optimizer"] == 8 * args.num_params() == 2 * one["parameters"]
    assert eight["optimizer"] == pytest.approx(one["optimizer"] / 8, rel=1e-6)
    assert eight["activations"] == one["activations"]
    assert parts(8, microbatch=2)["logits"] == 2 * eight["logits"] == 2 * 12 * 8192 * 128256
    assert parts(8, "full")["activations"] < eight["activations"] < parts(8, "none")["activations"]
    plain = parts(1, param_dtype="float32", reduce_dtype="float32")
    assert plain["gathered"] == 0 < one["gathered"]


def test_tensor_parallelism_splits_the_gathered_blocks_activations_and_logits():
    args = FLAVORS["70B"]
    run = dict(microbatch=1, seq_len=8192, param_dtype="bfloat16", reduce_dtype="float32")

    def parts(tp: int, mode: str) -> dict[str, int]:
        estimate = estimate_memory(
            args, world_size=64, checkpointing=Checkpointing(mode), tp=tp, **run
        )
        return {name: nbytes for name, nbytes, _ in estimate.parts}

    fsdp, tp8 = parts(1, "op"), parts(8, "op")
    assert tp8["parameters"] == fsdp["parameters"]  # 1/64 of the model either way
    assert tp8["gathered"] == fsdp["gathered"] // 8
    assert tp8["logits"] == fsdp["logits"] // 8
    # All but the recomputed block's gathered norm outputs are split.
    assert tp8["activations"] == pytest.approx(fsdp["activations"] / 8, rel=0.02)
    # Without checkpointing each rank keeps the norms' outputs all-gathered: not all split.
    assert parts(8, "none")["activations"] > parts(1, "none")["activations"] / 8
    assert intended_world_size(LLAMA3_8B.with_name("llama3_70b.toml")) == 64


ARGS = FLAVORS["debug"]
BATCH, SEQ = 2, 64
AC = ("--plugins.enabled", "activation_checkpointing", "--activation_checkpointing.mode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["none", "full", "op"])
def test_a_blocks_kept_activations_are_those_estimated(mode, dtype):
    """Bytes a block's forward leaves alive (kept for backward, and its output), measured on
    the CPU with the plugin as a run configures it: exactly the formula's."""
    plugin = ActivationCheckpointing()
    args = {"none": (), "full": (*AC, "full"), "op": (*AC, "selective")}[mode]
    with PeakMemory() as memory:  # the weights made inside: views of them are not new bytes
        ctx = model_context({"activation_checkpointing": plugin}, *args, model=Transformer(ARGS))
        if args:
            plugin.wrap_model(ctx)
        block = ctx.model.layers["0"].to(dtype)
        x = torch.randn(BATCH, SEQ, ARGS.dim, dtype=dtype, requires_grad=True)
        before = memory.live
        out = block(x, ctx.model.freqs_cis[:SEQ])
        kept = (memory.live - before) / (BATCH * SEQ)
    assert checkpointing_of(ctx.config) == Checkpointing(mode)
    # The output counts as the input it replaces, except in bf16 without checkpointing: there
    # a block keeps a float32 copy of its input (counted), not the input, so the output is extra.
    extra = ARGS.dim * dtype.itemsize if (mode, dtype) == ("none", torch.bfloat16) else 0
    assert kept == layer_bytes_per_token(ARGS, dtype.itemsize, mode) + extra
    assert out.dtype == dtype


def test_the_loss_peaks_at_three_fp32_logits():
    tokens, vocab = 128, 2048
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    with PeakMemory() as memory:
        F.cross_entropy(logits.float(), torch.randint(0, vocab, (tokens,))).backward()
    assert memory.peak == pytest.approx(12 * tokens * vocab, rel=0.01)


def test_plugtrain_estimate_prints_a_table_and_a_total(capsys):
    assert main(["estimate", str(LLAMA3_8B), "--gpus", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("memory estimate per process: 8B model, vocab 128256")
    assert "8 process(es), microbatch 1 x 8192 tokens" in out[0]
    assert [line.split()[0] for line in out[1:]] == [
        "parameters", "gradients", "optimizer", "gathered", "activations", "logits", "total",
    ]  # fmt: skip
    assert "selective activation checkpointing (by op)" in out[5]
    assert out[-1].split()[1:] == [f"{estimate_of(LLAMA3_8B) / 2**30:.2f}", "GiB"]


def test_plugtrain_estimate_names_a_batch_that_does_not_divide(capsys):
    assert main(["estimate", str(LLAMA3_8B.with_name("debug.toml")), "--gpus", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "plugtrain: error: training.batch_size 8 is not divisible by data-parallel ranks * "
        "grad_accum_steps = 3 * 1 = 3: set training.batch_size to a multiple of 3 or change "
        "grad_accum_steps"
    )


def test_plugtrain_estimate_refuses_degrees_that_do_not_fit_its_gpus(capsys):
    config = str(LLAMA3_8B.with_name("debug.toml"))
    assert main(["estimate", config, "--gpus", "4", "--parallelism.dp_replicate", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "parallelism.dp_replicate = 3" in err and "world size 4" in err and "\n" not in err


def test_a_run_logs_its_estimate_at_start_up(tmp_path, capsys):
    trainer = make_trainer(tmp_path, steps=1)
    try:
        trainer.train()
    finally:
        trainer.close()
    expected = estimate_run(trainer.config, 1, trainer.model_args.vocab_size).summary()
    logged = [line.split(" INFO ")[-1] for line in capsys.readouterr().err.splitlines()]
    assert f"memory estimate per process: {expected}" in logged
