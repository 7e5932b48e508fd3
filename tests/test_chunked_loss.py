"""The loss in chunks of tokens (``[model] loss_chunks``): the unchunked loss's numbers without
its full logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plugtrain.data import IGNORE_INDEX
from plugtrain.errors import ConfigError
from plugtrain.model import (
    ChunkedLoss,
    Transformer,
    cross_entropy,
    estimate_memory,
    summed_cross_entropy,
)
from plugtrain.model.llama.transformer import FLAVORS
from plugtrain.model.memory import Checkpointing
from plugtrain.testing import tiny_run
from plugtrain.training.launch import configure

TINY = FLAVORS["tiny"]


def _model(**options: object) -> Transformer:
    model = Transformer(dataclasses.replace(TINY, **options))
    model.init_weights(0)
    return model


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunks", [2, 3])  # 3 does not divide the 128 tokens
def test_the_chunked_loss_and_gradients_are_the_whole_logits_ones(tied, chunks):
    model = _model(tie_embeddings=tied)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (4, 33), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    whole = cross_entropy(logits, targets)
    whole_lse = torch.logsumexp(logits.float(), dim=-1)
    (whole + whole_lse.square().mean()).backward()  # the loss and a z-loss-like term
    expected = _grads(model)

    loss, lse = model(inputs, head=ChunkedLoss(targets, chunks, with_lse=True))
    (loss + lse.square().mean()).backward()
    assert torch.allclose(loss, whole, rtol=1e-6, atol=0)
    assert torch.allclose(lse, whole_lse, rtol=1e-6, atol=0)
    for name, grad in _grads(model).items():
        assert torch.allclose(grad, expected[name], rtol=1e-5, atol=1e-7), name
    # The lse is left out unless asked for.
    assert model(inputs, head=ChunkedLoss(targets, chunks))[1] is None


def test_backward_recomputes_each_chunks_logits_instead_of_keeping_them():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    vocab_sized = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-1:] == (TINY.vocab_size,):
            vocab_sized.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs, head=ChunkedLoss(targets, 4))
    assert vocab_sized == []  # checkpoint keeps each chunk's inputs, never its logits
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(model(inputs), targets)
    assert (4 * 32, TINY.vocab_size) in vocab_sized  # the whole logits, for log-softmax


def test_a_chunked_run_with_z_loss_trains_as_the_whole_logits_run(tmp_path):
    """Training, the z-loss term and validation: equal to float32 rounding over 4 steps."""
    args = (
        "--plugins.enabled", "z_loss", "--z_loss.weight", "0.1",
        "--validation.interval", "2", "--validation.steps", "1",
    )  # fmt: skip
    whole = tiny_run(tmp_path / "whole", *args, steps=4)
    chunked = tiny_run(tmp_path / "chunked", *args, "--model.loss_chunks", "3", steps=4)
    for ours, theirs in zip(chunked.metrics, whole.metrics, strict=True):
        for key in ("loss", "z_loss/z_loss", "validation_loss"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (key, ours["step"])
    assert sum("validation_loss" in r for r in chunked.metrics) == 2


def test_the_memory_estimate_holds_one_chunks_logits():
    def logits(chunks: int, tp: int = 1) -> int:
        estimate = estimate_memory(
            FLAVORS["debug"],
            world_size=tp,
            microbatch=8,
            seq_len=128,
            param_dtype="float32",
            reduce_dtype="float32",
            checkpointing=Checkpointing(),
            tp=tp,
            loss_chunks=chunks,
        )
        return dict((name, size) for name, size, _ in estimate.parts)["logits"]

    assert logits(1) == 8 * 128 * FLAVORS["debug"].vocab_size * 12
    assert logits(4) == logits(1) // 4
    assert logits(3) == 342 * FLAVORS["debug"].vocab_size * 12  # ceil(1024 / 3) tokens
    # Under tensor parallelism a rank holds its vocabulary shard of one chunk's logits.
    assert logits(4, tp=2) == logits(1) // 8


def test_zero_chunks_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'model.loss_chunks' must be >= 1, got 0"):
        configure(["--job.dump_folder", str(tmp_path), "--model.loss_chunks", "0"])


def test_the_summed_chunked_loss_skips_masked_targets_as_the_chat_loss_does():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[:, :20] = IGNORE_INDEX  # a prompt's tokens, as a chat loss mask leaves them
    whole = summed_cross_entropy(model(inputs), targets)
    loss, _ = model(inputs, head=ChunkedLoss(targets, 3, summed=True))
    assert torch.allclose(loss, whole, rtol=1e-6, atol=0)
