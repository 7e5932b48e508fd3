"""The moe family's :class:`~plugtrain.model.spec.ModelSpec`: ``MOE``, family ``moe``."""

from __future__ import annotations

from plugtrain.model.llama.pipeline import pipeline_split
from plugtrain.model.moe.args import FLAVORS, MoEArgs
from plugtrain.model.moe.hf import (
    from_hf,
    hf_config,
    model_args_from_hf,
    parameter_shapes,
    stacked,
    to_hf,
)
from plugtrain.model.moe.memory import estimate_memory
from plugtrain.model.moe.parallelize import check_tensor_parallel, parallelize
from plugtrain.model.moe.transformer import MoETransformer
from plugtrain.model.spec import HFAdapter, ModelSpec

__all__ = ["MOE"]

MOE = ModelSpec(
    name="moe",
    args=MoEArgs,
    flavors=FLAVORS,
    build=MoETransformer,
    init_plan=MoETransformer.init_plan,
    parallelize=parallelize,
    check_parallel=check_tensor_parallel,
    hf=HFAdapter(
        model_type="qwen3_moe",
        args_from_hf=model_args_from_hf,
        from_hf=from_hf,
        hf_config=hf_config,
        parameter_shapes=parameter_shapes,
        to_hf=to_hf,
        stacked=stacked,
    ),
    num_params=MoEArgs.num_params,
    flops_per_token=MoEArgs.flops_per_token,
    gemms=MoEArgs.gemms,
    memory=estimate_memory,
    pipeline_split=pipeline_split,
)
"""Qwen3-MoE's architecture (``moe/transformer.py``), at the shapes ``FLAVORS`` names or a
``Qwen3MoeForCausalLM`` config.json gives."""
