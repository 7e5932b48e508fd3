"""plugtrain plugin: activation checkpointing of the transformer blocks, full or selective.

A checkpointed block keeps only its input for backward and recomputes its forward there, so a
step holds one block's activations at a time instead of every block's. It wraps each chosen
block's forward in place (``wrap_model``, before FSDP2 shards the block), so parameter names,
checkpoints and ``init_weights`` are those of the run without it, and FSDP2's hooks stay
outside the recomputed region. Recomputation runs the same ops on the same inputs: losses and
parameters are bitwise those of the run without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from plugtrain.plugin import ModelContext, check_field, hookimpl, wrap_forward

__all__ = ["SAVED_OPS", "ActivationCheckpointing", "ActivationCheckpointingConfig"]

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.bmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
"""The ops whose outputs ``selective_by = "op"`` keeps: the matmuls and attention, which cost
the most to recompute; the elementwise ops (norms, RoPE, SiLU) are recomputed."""


@dataclass
class ActivationCheckpointingConfig:
    mode: Literal["full", "selective"] = "full"
    """``full`` checkpoints every block; ``selective`` saves more, recomputes less (see
    ``selective_by``)."""
    selective_by: Literal["layer", "op"] = "op"
    """With ``mode = "selective"``: ``layer`` checkpoints every ``every``-th block in full and
    leaves the others alone; ``op`` checkpoints every block but keeps the outputs of the
    matmuls and attention, recomputing only the cheap elementwise ops."""
    every: int = 2
    """With ``selective_by = "layer"``: checkpoint blocks every, 2*every, ... (1-based)."""

    def __post_init__(self) -> None:
        check_field(self.every >= 1, "every", f"must be >= 1, got {self.every}")


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(
    forward: Callable[..., Any], context_fn: Callable[[], Any] | None = None
) -> Callable[..., Any]:
    """``forward`` under ``torch.utils.checkpoint`` (non-reentrant), with ``context_fn``'s
    selective policy if given."""
    options: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        options["context_fn"] = context_fn

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, **options, **kwargs)

    return run


class ActivationCheckpointing:
    """Wraps the transformer blocks' forwards with activation checkpointing in ``wrap_model``."""

    def __init__(self) -> None:
        self.checkpointed_blocks: list[int] = []
        """Indices of the blocks this run checkpoints (set in ``wrap_model``)."""

    @hookimpl
    def config_section(self) -> type:
        return ActivationCheckpointingConfig

    @hookimpl
    def wrap_model(self, ctx: ModelContext) -> None:
        config: ActivationCheckpointingConfig = ctx.plugin_config(self)
        context_fn = None
        if config.mode == "selective" and config.selective_by == "op":
            context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        by_layer = config.mode == "selective" and config.selective_by == "layer"
        self.checkpointed_blocks = [
            i for i in range(len(ctx.blocks)) if not by_layer or (i + 1) % config.every == 0
        ]
        for i in self.checkpointed_blocks:
            wrap_forward(ctx.blocks[i], functools.partial(checkpointed, context_fn=context_fn))
