"""Activation checkpointing: the same numbers as without it, fewer activations kept."""

from __future__ import annotations

import pytest
import torch
from plugtrain_activation_checkpointing import ActivationCheckpointing

from plugtrain.plugin import ConfigError
from plugtrain.testing import PeakMemory, model_context, tiny_run

ENABLE = ("--plugins.enabled", "activation_checkpointing")
MODES = {
    "full": (),
    "selective-layer": ("--activation_checkpointing.mode", "selective",
                        "--activation_checkpointing.selective_by", "layer",
                        "--activation_checkpointing.every", "2"),
    "selective-op": ("--activation_checkpointing.mode", "selective"),
}  # fmt: skip


def peak_bytes(*args: str) -> tuple[int, list[int]]:
    """Peak bytes of the tiny model's forward and backward with the plugin configured by
    ``args`` (no args: the plugin not enabled), and the blocks it checkpointed."""
    plugin = ActivationCheckpointing()
    enable = ENABLE if args else ()
    ctx = model_context({"activation_checkpointing": plugin}, *enable, *args[1:])
    if args:
        plugin.wrap_model(ctx)
    tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    with PeakMemory() as memory:
        ctx.model(tokens).float().logsumexp(-1).mean().backward()
    return memory.peak, plugin.checkpointed_blocks


def test_each_mode_keeps_fewer_activations():
    none, _ = peak_bytes()
    (full, full_blocks), (layer, layer_blocks), (op, op_blocks) = (
        peak_bytes("on", *MODES[m]) for m in ("full", "selective-layer", "selective-op")
    )
    assert full_blocks == op_blocks == [0, 1] and layer_blocks == [1]
    # Full keeps only the blocks' inputs; the others keep more: half the blocks' activations,
    # or every block's matmul and attention outputs.
    assert full < layer < none and full < op < none, (full, layer, op, none)
    assert full < 0.6 * none


def test_losses_and_parameters_are_bitwise_those_of_the_run_without_it(plugtrain_run):
    # fp32, with clipping and two microbatches per step: recomputation runs the same ops.
    common = ("--training.grad_accum_steps", "2", "--grad_clip.max_norm", "0.5")
    plain = plugtrain_run("--plugins.enabled", "grad_clip", *common)
    assert len(plain.losses) == 3
    for mode, args in MODES.items():
        enable = ("--plugins.enabled", "grad_clip,activation_checkpointing")
        checkpointed = plugtrain_run(*enable, *common, *args)
        assert checkpointed.losses == plain.losses, mode
        assert checkpointed.checksums == plain.checksums, mode


def test_bitwise_too_under_fsdp2_mixed_precision(plugtrain_run):
    # bf16 compute is sharded by FSDP2 even in one process (a float32 one is not): the
    # checkpointed blocks carry its hooks, and recompute with the gathered bf16 parameters.
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    plain = plugtrain_run(*bf16)
    checkpointed = plugtrain_run(*ENABLE, *bf16)
    assert checkpointed.losses == plain.losses and checkpointed.checksums == plain.checksums


def test_checkpoints_are_interchangeable_with_the_run_without_it(tmp_path):
    save = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")
    straight = tiny_run(tmp_path / "straight", *save)
    tiny_run(tmp_path / "run", *ENABLE, *save)
    # Resume from step 2 of the run with the plugin, without it, and train step 3 again.
    again = ("--checkpoint.load_step", "2", "--checkpoint.discard_later", "true")
    resumed = tiny_run(tmp_path / "run", *save, *again)
    assert resumed.checksums == straight.checksums
    assert resumed.losses[3] == straight.losses[3]


def test_bad_every_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'activation_checkpointing.every' must be >= 1"):
        model_context({}, *ENABLE, "--activation_checkpointing.every", "0")
