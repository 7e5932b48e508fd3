"""QLoRA's base: the target weights held in torchao's NF4, 4 bits a value plus scales.

torchao (``pip install 'plugtrain-lora[qlora]'``) is imported on first use only: a run without
``lora.base_dtype = "nf4"`` never needs it. Each target weight is held as an ``NF4Tensor``
(QLoRA's double quantisation: one scale per 64 values, itself quantised to 8 bits per 256
scales around their mean), which ``F.linear`` reads back to the input's dtype and which FSDP2
splits and gathers as it is. The core converts each weight whole, then keeps each rank's rows
(``plugtrain.plugin.Storage``): the scales' mean is the whole weight's, so any world size
computes with the same weights, provided the rows split into whole blocks of scales, which
:func:`check_nf4` makes sure of.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from types import ModuleType

import torch
from torch import nn

from plugtrain.plugin import ConvertContext, PluginError, Storage

BLOCK = 64
"""Values per scale (QLoRA's, torchao's default)."""
SCALER_BLOCK = 256
"""Scales per 8-bit group of scales (torchao's default)."""
UNIT = BLOCK * SCALER_BLOCK
"""The values a target weight, and each rank's shard of it, must hold a whole number of."""
EXTRA = "pip install 'plugtrain-lora[qlora]'"
"""What installs torchao, NF4's implementation, at the version plugtrain is tested with."""


def torchao_missing() -> bool:
    """Whether torchao is not installed."""
    return importlib.util.find_spec("torchao") is None


@functools.cache
def _nf4_module() -> ModuleType:
    # torchao warns, at import, of every kernel library the machine cannot load (CUDA-only
    # ones on a CPU) and, through torch, of a deprecated registration; NF4 needs none of them.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return nf4_tensor


def to_nf4(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a float32 weight, meta included) as an ``NF4Tensor``."""
    return _nf4_module().to_nf4(t, BLOCK, SCALER_BLOCK)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a QLoRA run computes with it: held in NF4, read back in float32."""
    return to_nf4(weight.float()).get_original_weight()


def nf4_bytes(shape: tuple[int, ...]) -> int:
    """The bytes an ``NF4Tensor`` of a float32 weight of ``shape`` holds: half a byte a value,
    an 8-bit scale per block, a float32 factor per group of scales, their mean and the table
    of the 16 NF4 values."""
    n = math.prod(shape)
    return n // 2 + n // BLOCK + 4 * (n // UNIT) + 4 + 16 * 4


NF4 = Storage("nf4", to_nf4, nf4_bytes)
"""How a QLoRA run holds its target weights (``ctx.freeze(..., storage=NF4)``)."""


def check_nf4(ctx: ConvertContext, linears: dict[str, nn.Linear]) -> None:
    """Refuse, in one line, a run whose target weights (``linears`` by module name) cannot be
    held in NF4 as one process holds them: tensor parallelism (not supported yet), or a weight
    that does not split into whole groups of scales over the FSDP shards."""
    dims = ctx.parallel_dims
    if dims.tp_enabled:
        raise PluginError(
            f"lora.base_dtype = 'nf4' with parallelism.tp = {dims.tp} is not supported yet: "
            "set parallelism.tp = 1, or lora.base_dtype = 'float32'"
        )
    shards = dims.dp_shard
    for module, linear in linears.items():
        rows, columns = linear.weight.shape
        if rows % shards or (rows * columns) % (UNIT * shards):
            where = f" over parallelism.dp_shard = {shards}" if shards > 1 else ""
            raise PluginError(
                f"lora.base_dtype = 'nf4' holds each target weight in groups of {UNIT} values "
                f"split whole{where}, which '{module}.weight' ({rows} x {columns}) does not "
                f"allow: leave '{module.rpartition('.')[2]}' out of lora.targets, or set "
                "lora.base_dtype = 'float32'"
            )
