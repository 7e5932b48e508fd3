"""grad_clip on 2 FSDP2 processes against torch.nn.utils.clip_grad_norm_ on 1 plain process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from plugtrain.config import JobConfig
from plugtrain.data.pipeline import StatefulBatchLoader, build_dataset
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.model.transformer import FLAVORS, Transformer
from plugtrain.plugin import full_tensor
from plugtrain.testing import make_trainer, read_metrics, run_distributed, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.optim import LRSchedule, build_optimizer
from plugtrain.training.trainer import cross_entropy

STEPS = 4
# Measured: the 2-process parameters are within 4e-7 of the reference after 4 steps; clipping
# moves each parameter tensor by 1.4e-4 or more.
RTOL, ATOL = 1e-5, 1e-6


def train_and_gather(dump_folder: str, args: list[str], steps: int) -> dict[str, torch.Tensor]:
    """Run on each rank: train a tiny run; return its full parameters, by name."""
    trainer = make_trainer(dump_folder, *args, steps=steps)
    trainer.train()
    trainer.close()
    return {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}


def reference_run(
    config: JobConfig, max_norm: float | None, norm_type: float
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run as the trainer's, written out: one process, no FSDP, one microbatch.

    Clips with ``torch.nn.utils.clip_grad_norm_`` unless ``max_norm`` is None; returns the
    pre-clip total norm of each step and the final parameters.
    """
    train = config.training
    tokenizer = Tokenizer.from_file(config.model.tokenizer_path)
    data = build_dataset(
        config.data.train_path, "data.train_path", tokenizer, config.data.text_field, train.seq_len
    )
    loader = StatefulBatchLoader(
        data, global_batch_size=train.batch_size, grad_accum_steps=1, rank=0, world_size=1,
        seed=train.seed, shuffle=config.data.shuffle,
    )  # fmt: skip
    flavor = FLAVORS[config.model.flavor]
    model = Transformer(
        dataclasses.replace(
            flavor,
            vocab_size=tokenizer.vocab_size,
            max_seq_len=max(flavor.max_seq_len, train.seq_len),
        )
    )
    model.init_weights(seed=train.seed)
    optimizer = build_optimizer(model, config.optimizer, torch.device("cpu"))
    scheduler = LRSchedule(optimizer, config.lr_scheduler, train.steps)
    norms = []
    for _ in range(train.steps):
        ((inputs, targets),) = loader.next_batch()
        cross_entropy(model(inputs), targets).backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            norms.append(norm.item())
        optimizer.step()
        scheduler.step(torch.tensor(True))
        optimizer.zero_grad(set_to_none=True)
    return norms, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("norm_type", "max_norm", "accum"),
    [(2.0, 0.1, 1), (math.inf, 0.02, 2)],
    ids=["l2", "inf-accum2"],
)
def test_two_fsdp2_processes_match_clip_grad_norm(tmp_path, clip_args, norm_type, max_norm, accum):
    args = [
        "--training.batch_size", "8", "--training.grad_accum_steps", str(accum),
        *clip_args(max_norm, "--grad_clip.norm_type", str(norm_type)),
    ]  # fmt: skip
    ranks = run_distributed(train_and_gather, 2, str(tmp_path / "run"), args, STEPS)
    config, _ = configure([*tiny_args(tmp_path / "ref", steps=STEPS), *args])
    ref_norms, ref_params = reference_run(config, max_norm, norm_type)
    _, unclipped = reference_run(config, None, norm_type)

    records = read_metrics(tmp_path / "run")
    assert [r["grad_clip/grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert min(ref_norms) > max_norm  # every step clips...
    assert [r["grad_clip/clipped"] for r in records] == [1.0] * STEPS
    for name, ref in ref_params.items():
        # ...and moves every parameter at least 10x further than the tolerance below.
        assert (ref - unclipped[name]).abs().max() > 10 * ATOL, name
        for rank, params in enumerate(ranks):
            torch.testing.assert_close(
                params[name], ref, rtol=RTOL, atol=ATOL, msg=f"{name} on rank {rank}"
            )
