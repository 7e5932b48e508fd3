"""The moe family's tensor parallelism: none yet, refused in one line."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plugtrain.errors import ConfigError
from plugtrain.model.moe.args import MoEArgs

__all__ = ["check_tensor_parallel", "parallelize"]


def check_tensor_parallel(args: MoEArgs, tp: int, seq_len: int) -> None:
    """Refuse ``tp`` > 1: the family has no tensor-parallel plan (its experts are split by
    expert parallelism instead)."""
    if tp > 1:
        raise ConfigError(
            f"parallelism.tp = {tp}, but model.family 'moe' has no tensor parallelism yet: set "
            "parallelism.tp = 1 (shard the model with dp_shard)"
        )


def parallelize(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Never called: :func:`check_tensor_parallel` refuses ``tp`` > 1 first."""
    raise NotImplementedError("the moe family has no tensor-parallel plan")
