"""FSDP2 sharding of the model, with the run's mixed-precision policy."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The config's dtype names (``training.mixed_precision_*``) as torch dtypes."""


def shard_model(
    model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> MixedPrecisionPolicy:
    """Apply FSDP2 to each transformer block, then to the root; return the policy used."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = list(model.layers)
    for i, block in enumerate(layers):
        # NOTE: the last block stays gathered after forward, since backward needs it at once.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return policy
