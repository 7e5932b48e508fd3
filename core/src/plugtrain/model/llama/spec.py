"""The Llama family's :class:`~plugtrain.model.spec.ModelSpec`: ``LLAMA``, family ``llama``."""

from __future__ import annotations

from plugtrain.model.llama.args import FLAVORS, ModelArgs
from plugtrain.model.llama.hf import from_hf, hf_config, model_args_from_hf, parameter_shapes, to_hf
from plugtrain.model.llama.memory import estimate_memory
from plugtrain.model.llama.parallelize import check_tensor_parallel, parallelize
from plugtrain.model.llama.pipeline import pipeline_split
from plugtrain.model.llama.transformer import Transformer
from plugtrain.model.spec import HFAdapter, ModelSpec

__all__ = ["LLAMA"]

LLAMA = ModelSpec(
    name="llama",
    args=ModelArgs,
    flavors=FLAVORS,
    build=Transformer,
    init_plan=Transformer.init_plan,
    parallelize=parallelize,
    check_parallel=check_tensor_parallel,
    hf=HFAdapter(
        model_type="llama",
        args_from_hf=model_args_from_hf,
        from_hf=from_hf,
        hf_config=hf_config,
        parameter_shapes=parameter_shapes,
        to_hf=to_hf,
    ),
    num_params=ModelArgs.num_params,
    flops_per_token=ModelArgs.flops_per_token,
    gemms=ModelArgs.gemms,
    memory=estimate_memory,
    pipeline_split=pipeline_split,
)
"""Llama 3's architecture (``llama/transformer.py``), at the shapes ``FLAVORS`` names or a
``LlamaForCausalLM`` config.json gives."""
