"""Tensor parallelism (``parallelism.tp``): TP 2 on 2 processes and TP 2 x FSDP 2 on 4 against
1 process with the shipped plugins in fp16 (and TP 2 with tied embeddings in fp32), an inf on
one rank, checkpoints resumed across the layouts (with and without TP, on 1, 2 and 4
processes), initial loads, Hugging Face exports read by transformers, and refused degrees.

The multi-process checks share one 2-process and one 4-process launch through a module-scoped
fixture.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from plugtrain_compile import Compile

from plugtrain.checkpoint import export_checkpoint, read_checkpoint
from plugtrain.commands.generate import load as load_model
from plugtrain.data import Tokenizer
from plugtrain.distributed import mesh_shape
from plugtrain.errors import ConfigError
from plugtrain.model import FLAVORS, check_tensor_parallel, from_hf, run_model_args, to_hf
from plugtrain.plugin import ParallelDims, full_tensor
from plugtrain.testing import (
    SAMPLE,
    InjectInf,
    make_trainer,
    max_difference,
    metrics_by_step,
    model_context,
    run_distributed,
    save_random_llama,
)
from plugtrain.testing.hf import hf_llama_logits

STEPS, SAVED, INF_STEP = 10, 8, 4
SEQ_LEN = 32  # tiny_args'
TIED_STEPS = 4
TP2 = ("--parallelism.tp", "2")
PLUGINS = "grad_clip,grad_scaler,spike_guard,ema,z_loss,activation_checkpointing"
RUN = (
    "--training.mixed_precision_param", "float16",
    "--plugins.enabled", PLUGINS,
    "--grad_clip.max_norm", "0.5",
    "--grad_scaler.init_scale", "1024",
    "--spike_guard.warmup_steps", "3",
    "--checkpoint.enable", "true",
    "--checkpoint.interval", str(SAVED),
    "--validation.interval", str(STEPS),
    "--validation.steps", "1",
)  # fmt: skip
"""fp16 with every shipped plugin that reduces (grad_clip's norm, grad_scaler's inf flag,
spike_guard's loss, z_loss's term of the vocabulary-sharded logits, ema's average) and
activation checkpointing, on the tiny model (4 heads, 2 key/value heads: 2 and 1 per rank)."""
EXPORTING = ("--plugins.enabled", f"{PLUGINS},hf_export", "--hf_export.every", "last")
"""The plugins of ``RUN`` and hf_export, which writes the last checkpoint as a Hugging Face
folder (``step-<STEPS>/hf/``)."""
COMPARED = (
    "loss",
    "grad_clip/grad_norm",
    "grad_scaler/loss_scale",
    "spike_guard/window_mean.loss",
    "z_loss/z_loss",
    "validation_loss",
    "ema/validation_loss",
)
TOLERANCE = 1e-4
"""Measured max differences (fp16 compute, fp32 reduce) against 1 process over 10 steps: TP 2
6.1e-5 (the losses 4.5e-5, the clipped norms 2.1e-5), TP 2 x FSDP 2 6.1e-5 (4.2e-5, 1.9e-5);
resumed runs against the run they continue (``RESUMES``) 1.8e-5 (TP 2 to 1 process), 2.0e-5
(1 process to TP 2), 2.4e-5 (TP 2 x FSDP 2 to 1 process), 2.7e-5 (to FSDP 2), 2.3e-5 (to FSDP
4), 1.4e-5 (1 process to TP 2 x FSDP 2)."""


def train(folder: Path, *args: str, inf_rank: int | None = None) -> int:
    """Train ``RUN`` + ``args`` (inf in ``inf_rank``'s gradients at ``INF_STEP``); this rank's
    skipped steps."""
    plugins = [("inject", InjectInf(steps={INF_STEP}, ranks={inf_rank}))]
    trainer = make_trainer(folder, *RUN, *args, steps=STEPS, plugins=plugins)
    trainer.run()
    return int(trainer.host.get("grad_scaler").skipped_steps)


def initialized(root: Path, name: str, source: Path, *args: str) -> dict[str, torch.Tensor] | None:
    """The weights, whole, of run ``name`` (``RUN`` + ``args``) initialized from ``source`` (a
    Hugging Face folder or a step-N checkpoint) before its first step: on rank 0 (None on the
    others)."""
    load = ("--checkpoint.initial_load_path", str(source))
    trainer = make_trainer(root / name, *RUN, *args, *load)
    try:
        weights = {k: full_tensor(p.detach()) for k, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return weights if not dist.is_initialized() or dist.get_rank() == 0 else None


def train_tied(folder: Path, *args: str) -> None:
    """Train ``TIED_STEPS`` steps of the tiny model with tied embeddings, in fp32, + ``args``."""
    make_trainer(folder, "--model.tie_embeddings", "true", *args, steps=TIED_STEPS).run()


def copy_checkpoint(written: Path, resumed: Path) -> None:
    """Copy run ``written``'s step-``SAVED`` checkpoint into the new dump folder ``resumed``."""
    step = f"checkpoints/step-{SAVED}"
    shutil.copytree(written / step, resumed / step)


def resume(root: Path, written: str, resumed: str, *args: str) -> None:
    """Resume run ``written``'s step-``SAVED`` checkpoint in the new run ``resumed`` (``RUN`` +
    ``args``): steps ``SAVED + 1`` to ``STEPS``. On every rank of the launch, or in 1 process."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        copy_checkpoint(root / written, root / resumed)
    if dist.is_initialized():
        dist.barrier()
    train(root / resumed, *args)


def four_ranks(base: str) -> dict:
    """On each of 4 ranks: TP 2 x FSDP 2 with an inf in rank 3's gradients, hf_export writing
    its last checkpoint as a Hugging Face folder; the 1-process checkpoint resumed under TP 2 x
    FSDP 2; the TP 2 x FSDP 2 checkpoint resumed on FSDP 4 (no TP); TP 2 x FSDP 2 initialized
    from the Hugging Face folder."""
    root = Path(base)
    skipped = train(root / "tp2_fsdp2", *TP2, *EXPORTING, inf_rank=3)
    resume(root, "one", "one_to_tp2_fsdp2", *TP2)
    resume(root, "tp2_fsdp2", "tp2_fsdp2_to_fsdp4")
    return {
        "skipped": skipped,
        "from_hf": initialized(root, "tp2_fsdp2_from_hf", root / "hf", *TP2),
    }


def two_ranks(base: str) -> dict:
    """On each of 2 ranks: TP 2 with an inf in rank 1's gradients; the 1-process checkpoint
    resumed under TP 2; the TP 2 x FSDP 2 checkpoint resumed on FSDP 2 (no TP); TP 2
    initialized from the Hugging Face folder, and from the 1-process step-``SAVED`` checkpoint;
    TP 2 with tied embeddings."""
    root = Path(base)
    skipped = train(root / "tp2", *TP2, inf_rank=1)
    resume(root, "one", "one_to_tp2", *TP2)
    resume(root, "tp2_fsdp2", "tp2_fsdp2_to_fsdp2")
    from_hf = initialized(root, "tp2_from_hf", root / "hf", *TP2)
    from_step = initialized(root, "tp2_from_step", root / "one" / f"checkpoints/step-{SAVED}", *TP2)
    train_tied(root / "tied_tp2", *TP2)
    return {"skipped": skipped, "from_hf": from_hf, "from_step": from_step}


RESUMES = {
    "tp2_to_one": "tp2",
    "one_to_tp2": "one",
    "tp2_fsdp2_to_one": "tp2_fsdp2",
    "tp2_fsdp2_to_fsdp2": "tp2_fsdp2",
    "tp2_fsdp2_to_fsdp4": "tp2_fsdp2",
    "one_to_tp2_fsdp2": "one",
}
"""Each resumed run, and the run whose step-``SAVED`` checkpoint it continues."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tp")
    # A random Hugging Face model of the tiny shape, for the initial loads.
    vocab = Tokenizer.from_file(SAMPLE / "tokenizer.json").vocab_size
    hf_args = run_model_args("tiny", vocab, SEQ_LEN)
    save_random_llama(base / "hf", hf_args)
    one = train(base / "one", inf_rank=0)
    train_tied(base / "tied_one")
    four = run_distributed(four_ranks, 4, str(base))  # first: the 2-process launch resumes it
    ranks = run_distributed(two_ranks, 2, str(base))
    resume(base, "tp2", "tp2_to_one")
    resume(base, "tp2_fsdp2", "tp2_fsdp2_to_one")
    from_hf = {"one": initialized(base, "one_from_hf", base / "hf"), "tp2": ranks[0]["from_hf"]}
    from_hf["tp2_fsdp2"] = four[0]["from_hf"]
    names = ("one", "tp2", "tp2_fsdp2", *RESUMES, "tied_one", "tied_tp2")
    return {
        "base": base,
        "one": one,
        "ranks": ranks,
        "four": four,
        "from_hf": from_hf,
        "from_step": ranks[0]["from_step"],
        "hf_args": hf_args,
        "metrics": {name: metrics_by_step(base / name) for name in names},
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2_fsdp2"])
def test_tensor_parallelism_matches_one_process_with_the_plugins(runs, layout):
    m = runs["metrics"]
    steps = range(1, STEPS + 1)
    assert all(k in m[layout][STEPS] for k in COMPARED), sorted(m[layout][STEPS])
    assert not any(math.isnan(m[layout][s]["loss"]) for s in steps)
    losses = max_difference(m[layout], m["one"], steps, ["loss"])
    norms = max_difference(m[layout], m["one"], steps, ["grad_clip/grad_norm"])
    every = max_difference(m[layout], m["one"], steps, COMPARED)
    print(f"{layout} vs 1 process: losses {losses:.3g}, clipped norms {norms:.3g}, all {every:.3g}")
    assert every < TOLERANCE, f"{layout} vs 1 process: max difference {every:.3g}"
    assert m[layout][STEPS]["grad_clip/grad_norm"] > 0.5  # clipping was active


@pytest.mark.slow
def test_tied_embeddings_under_tensor_parallelism_match_one_process(runs):
    """One vocabulary-split matrix embeds and projects (its gradient sums both uses): TP 2's
    fp32 losses are 1 process's over the steps, each after an update of the tied matrix."""
    m = runs["metrics"]
    steps = range(1, TIED_STEPS + 1)
    difference = max_difference(m["tied_tp2"], m["tied_one"], steps, ["loss"])
    print(f"tied embeddings, TP 2 vs 1 process: losses {difference:.3g}")
    assert difference < 1e-5, f"tied embeddings: max difference {difference:.3g}"


@pytest.mark.slow
def test_an_inf_on_one_rank_skips_the_step_on_all(runs):
    m = runs["metrics"]
    assert runs["one"] == 1
    assert [r["skipped"] for r in runs["ranks"]] == [1, 1]
    assert [r["skipped"] for r in runs["four"]] == [1, 1, 1, 1]
    for layout in ("tp2", "tp2_fsdp2"):
        assert m[layout][INF_STEP]["skipped_steps"] == 1
        assert m[layout][INF_STEP - 1]["skipped_steps"] == 0
        halved = m[layout][INF_STEP]["grad_scaler/loss_scale"]
        assert halved == m["one"][INF_STEP]["grad_scaler/loss_scale"] == 512.0


@pytest.mark.slow
@pytest.mark.parametrize("resumed, written", RESUMES.items())
def test_a_checkpoint_resumes_across_tensor_parallelism(runs, resumed, written):
    m = runs["metrics"]
    assert min(m[resumed]) == SAVED + 1  # resumed, not trained from scratch
    difference = max_difference(m[resumed], m[written], range(SAVED + 1, STEPS + 1), COMPARED)
    print(f"{resumed} vs {written}: max difference {difference:.3g}")
    assert difference < TOLERANCE, f"{resumed}: max difference {difference:.3g}"


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_the_weights_it_resumes_with(runs):
    """export-hf reads TP 2's DCP files one tensor at a time: the tensors a 1-process resume
    of the same checkpoint loads (resharded by DCP), bit for bit."""
    from safetensors.torch import load_file

    base = runs["base"]
    out = base / "tp2_hf"
    export_checkpoint(base / "tp2" / f"checkpoints/step-{SAVED}", out, dtype=torch.float32)
    exported = load_file(out / "model.safetensors")
    copy_checkpoint(base / "tp2", base / "tp2_loaded")
    trainer = make_trainer(base / "tp2_loaded", *RUN, steps=STEPS)
    try:
        assert trainer.step == SAVED
        loaded = dict(
            to_hf(name, full_tensor(tensor), trainer.model_args)
            for name, tensor in trainer.model.state_dict().items()
        )
    finally:
        trainer.abort()
    assert exported.keys() == loaded.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, loaded[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2_fsdp2"])
def test_a_hugging_face_initial_load_under_tensor_parallelism_gives_the_1_process_weights(
    runs, layout
):
    """Each rank reads its blocks of the folder's tensors (rows of the column-wise projections,
    columns of the row-wise ones, FSDP's rows of those): put together, the weights 1 process
    loads, bit for bit, which are the folder's (not an initialisation, which would match too)."""
    from safetensors.torch import load_file

    stored = load_file(runs["base"] / "hf" / "model.safetensors")
    folder = dict(from_hf(name, tensor, runs["hf_args"]) for name, tensor in stored.items())
    ours, reference = runs["from_hf"][layout], runs["from_hf"]["one"]
    assert ours.keys() == reference.keys() == folder.keys()
    for name, tensor in ours.items():
        assert torch.equal(reference[name], folder[name]), name
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_a_checkpoint_initial_load_under_tensor_parallelism_gives_its_weights(runs):
    """DCP reshards a 1-process step-N checkpoint onto TP 2 as it does on a resume."""
    step = runs["base"] / "one" / f"checkpoints/step-{SAVED}"
    saved = {k.removeprefix("model."): v for k, v in read_checkpoint(step, "model.").items()}
    loaded = runs["from_step"]
    assert loaded.keys() == saved.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["export-hf", "hf_export"])
def test_transformers_reads_an_export_of_a_tensor_parallel_checkpoint(runs, writer):
    """TP 2 x FSDP 2's checkpoint as a Hugging Face folder, written by export-hf after the run
    (step ``SAVED``) or by the hf_export plugin during it (step ``STEPS``): transformers'
    ``LlamaForCausalLM`` gives the logits of plugtrain's 1-process model of that checkpoint."""
    checkpoints = runs["base"] / "tp2_fsdp2" / "checkpoints"
    if writer == "export-hf":
        checkpoint, out = checkpoints / f"step-{SAVED}", runs["base"] / "tp2_fsdp2_hf"
        export_checkpoint(checkpoint, out, dtype=torch.float32)
    else:
        checkpoint = checkpoints / f"step-{STEPS}"
        out = checkpoint / "hf"
    model, tokenizer = load_model(checkpoint)
    tokens = torch.randint(
        tokenizer.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = model(tokens)
    error = (hf_llama_logits(out, tokens) - ours).abs().max().item()
    print(f"{writer}: transformers vs plugtrain, max logit difference {error:.3g}")
    assert error < 1e-5, f"{writer}: max logit difference {error:.3g}"


@pytest.mark.parametrize(
    "world, replicate, shard, tp, shape",
    [(2, 1, -1, 2, (1, 1, 2)), (4, 1, -1, 2, (1, 2, 2)), (16, 2, -1, 4, (2, 2, 4))],
)
def test_mesh_shapes_with_tensor_parallelism(world, replicate, shard, tp, shape):
    assert mesh_shape(world, replicate, shard, tp) == shape


def test_a_tp_that_does_not_divide_the_world_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError) as refused:
        make_trainer(tmp_path / "run", *TP2)
    assert str(refused.value) == (
        "parallelism.tp = 2 does not divide the world size 1: launch a multiple of 2 "
        "processes, or set tp to a divisor of 1"
    )
    assert not (tmp_path / "run").exists()


TINY = FLAVORS["tiny"]  # 4 heads, 2 key/value heads, FFN 96


@pytest.mark.parametrize(
    "tp, args, seq_len, culprit",
    [
        (3, TINY, 32, "model.n_heads = 4"),
        (4, TINY, 32, "model.n_kv_heads = 2"),
        (2, dataclasses.replace(TINY, ffn_dim=33), 32, "the FFN hidden size (model.ffn_dim) = 33"),
        (2, TINY, 31, "training.seq_len = 31"),
    ],
)
def test_degrees_the_model_cannot_split_are_refused(tp, args, seq_len, culprit):
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(args, tp, seq_len)
    message = str(refused.value)
    assert message.startswith(f"parallelism.tp = {tp} does not divide {culprit}: "), message
    assert "\n" not in message


@pytest.mark.parametrize("name, plugin", [("compile", Compile)])
def test_the_plugins_not_ready_for_tensor_parallelism_refuse_it_in_one_line(name, plugin):
    plugin = plugin()
    ctx = model_context({name: plugin}, "--plugins.enabled", name, parallel_dims=ParallelDims(tp=2))
    with pytest.raises(ConfigError) as refused:
        plugin.compile_model(ctx=ctx)  # its first hook
    assert str(refused.value) == (
        f"plugin '{name}' does not run under tensor parallelism yet (parallelism.tp = 2): "
        f"remove '{name}' from plugins.enabled, or set parallelism.tp = 1"
    )
