"""The model transforms on CUDA: activation checkpointing bitwise and lighter, compile close.

Activation checkpointing recomputes the same kernels: losses and parameters equal those of the
run without it, bit for bit (deterministic kernels), and a step of the debug model at 8 x 256
tokens peaks lower (``max_memory_allocated``). The compile plugin (inductor on CUDA) fuses
kernels, so its losses equal the eager ones to a tolerance.
"""

from __future__ import annotations

import pytest
import torch

from plugtrain.testing import make_trainer

COMMON = ("--training.grad_accum_steps", "2", "--grad_clip.max_norm", "0.5")
AC = ("--plugins.enabled", "grad_clip,activation_checkpointing")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_is_bitwise_the_run_without_it(
    plugtrain_run, device_args, deterministic, dtype
):
    args = (*device_args, *COMMON, "--training.mixed_precision_param", dtype)
    plain = plugtrain_run("--plugins.enabled", "grad_clip", *args)
    checkpointed = plugtrain_run(*AC, *args)
    assert len(plain.losses) == 3
    assert checkpointed.losses == plain.losses
    assert checkpointed.checksums == plain.checksums


def step_peak(tmp_path, device_args, peak_bytes, *args: str) -> int:
    """Peak bytes of the second step of the debug model at 8 x 256 tokens, fp32."""
    trainer = make_trainer(
        tmp_path, *device_args, "--model.flavor", "debug", "--training.batch_size", "8",
        "--training.seq_len", "256", *args, steps=2,
    )  # fmt: skip
    trainer.train_step(trainer.batches.next_batch())  # the optimizer's state is allocated
    batch = trainer.batches.next_batch()
    with peak_bytes() as peak:
        trainer.train_step(batch)
    trainer.close()
    return peak["bytes"]


def test_activation_checkpointing_lowers_the_peak_memory(tmp_path, device_args, peak_bytes):
    plain = step_peak(tmp_path / "plain", device_args, peak_bytes)
    checkpointed = step_peak(
        tmp_path / "ac", device_args, peak_bytes, "--plugins.enabled", "activation_checkpointing"
    )
    # Full checkpointing keeps each block's input only, and recomputes one block at a time;
    # the logits, their gradient and the parameters' gradients stay (about a third on CUDA).
    assert 0 < checkpointed < 0.75 * plain, (checkpointed, plain)


def test_compiled_runs_train_as_the_eager_run(plugtrain_run, device, device_args, fresh_dynamo):
    # inductor on CUDA; on the CPU (the hidden switch) aot_eager needs no C++ compiler.
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    args = (*device_args, *COMMON, "--compile.backend", backend)
    plain = plugtrain_run("--plugins.enabled", "grad_clip", *device_args, *COMMON)
    for enabled in ("grad_clip,compile", "grad_clip,compile,activation_checkpointing"):
        compiled = plugtrain_run("--plugins.enabled", enabled, *args)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, enabled
        assert list(compiled.losses) == [1, 2, 3], enabled
        for step, loss in plain.losses.items():
            assert compiled.losses[step] == pytest.approx(loss, rel=1e-4), (enabled, step)
