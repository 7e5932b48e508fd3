"""The model: the family seam (``ModelSpec``), Llama, mixture of experts, FSDP2 and TP."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.model.context_parallel import ContextParallel as ContextParallel
    from plugtrain.model.context_parallel import zigzag_indices as zigzag_indices
    from plugtrain.model.conversion import AdapterExport as AdapterExport
    from plugtrain.model.conversion import AdapterWriter as AdapterWriter
    from plugtrain.model.conversion import Conversion as Conversion
    from plugtrain.model.conversion import ExportRule as ExportRule
    from plugtrain.model.conversion import LazyTensors as LazyTensors
    from plugtrain.model.conversion import MergeInto as MergeInto
    from plugtrain.model.conversion import ShardLike as ShardLike
    from plugtrain.model.conversion import Storage as Storage
    from plugtrain.model.conversion import Switch as Switch
    from plugtrain.model.conversion import TensorParallelStyle as TensorParallelStyle
    from plugtrain.model.conversion import conversion_of as conversion_of
    from plugtrain.model.decoding import TextTokenizer as TextTokenizer
    from plugtrain.model.decoding import complete as complete
    from plugtrain.model.decoding import generate as generate
    from plugtrain.model.decoding import next_token as next_token
    from plugtrain.model.families import FAMILIES as FAMILIES
    from plugtrain.model.families import check_family as check_family
    from plugtrain.model.families import hf_model_spec as hf_model_spec
    from plugtrain.model.families import model_spec as model_spec
    from plugtrain.model.families import unknown_family as unknown_family
    from plugtrain.model.gemm import Gemm as Gemm
    from plugtrain.model.init import Fill as Fill
    from plugtrain.model.init import initialize as initialize
    from plugtrain.model.llama.args import FLAVORS as FLAVORS
    from plugtrain.model.llama.args import ModelArgs as ModelArgs
    from plugtrain.model.llama.args import RopeScaling as RopeScaling
    from plugtrain.model.llama.args import run_model_args as run_model_args
    from plugtrain.model.llama.hf import from_hf as from_hf
    from plugtrain.model.llama.hf import hf_config as hf_config
    from plugtrain.model.llama.hf import model_args_from_hf as model_args_from_hf
    from plugtrain.model.llama.hf import parameter_shapes as parameter_shapes
    from plugtrain.model.llama.hf import to_hf as to_hf
    from plugtrain.model.llama.memory import estimate_memory as estimate_memory
    from plugtrain.model.llama.parallelize import check_tensor_parallel as check_tensor_parallel
    from plugtrain.model.llama.spec import LLAMA as LLAMA
    from plugtrain.model.llama.transformer import KVCache as KVCache
    from plugtrain.model.llama.transformer import Transformer as Transformer
    from plugtrain.model.llama.transformer import scale_rope_frequencies as scale_rope_frequencies
    from plugtrain.model.loss import ChunkedLoss as ChunkedLoss
    from plugtrain.model.loss import cross_entropy as cross_entropy
    from plugtrain.model.loss import logsumexp as logsumexp
    from plugtrain.model.loss import parallel_cross_entropy as parallel_cross_entropy
    from plugtrain.model.loss import (
        parallel_summed_cross_entropy as parallel_summed_cross_entropy,
    )
    from plugtrain.model.loss import summed_cross_entropy as summed_cross_entropy
    from plugtrain.model.memory import Checkpointing as Checkpointing
    from plugtrain.model.memory import MemoryEstimate as MemoryEstimate
    from plugtrain.model.memory import PipelineShare as PipelineShare
    from plugtrain.model.memory import size_text as size_text
    from plugtrain.model.moe.args import MoEArgs as MoEArgs
    from plugtrain.model.moe.spec import MOE as MOE
    from plugtrain.model.moe.transformer import MoETransformer as MoETransformer
    from plugtrain.model.sharding import DTYPES as DTYPES
    from plugtrain.model.sharding import build_model as build_model
    from plugtrain.model.sharding import pipeline_stages as pipeline_stages
    from plugtrain.model.sharding import replica_sync as replica_sync
    from plugtrain.model.sharding import reshard as reshard
    from plugtrain.model.spec import HFAdapter as HFAdapter
    from plugtrain.model.spec import ModelSpec as ModelSpec
    from plugtrain.model.spec import piece as piece
    from plugtrain.model.spec import read_hf_config as read_hf_config
    from plugtrain.model.tensor_parallel import tensor_parallel_degree as tensor_parallel_degree
    from plugtrain.model.tensor_parallel import whole_logits as whole_logits
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
