"""The Llama family's memory formula: what a training step holds on each device, by part.

:func:`estimate_memory` adds up, in bytes per process, what a training step holds at its peak
(the start of the last microbatch's backward, when every activation is still kept and the
gradients of earlier microbatches are there):

* **parameters**, **gradients** and **optimizer** state: fp32 parameters and gradients, and
  fused AdamW's two fp32 moments, 4 + 4 + 8 bytes a parameter, divided by the world size when
  FSDP2 shards the model (see :func:`~plugtrain.model.sharding.needs_sharding`);
* **gathered**: what FSDP2 all-gathers in the compute dtype: the root's parameters (embedding,
  final norm, output projection unless tied to the embedding: kept from forward to the end of
  backward) and two blocks (the one computing and the one prefetched); and the unsharded
  gradients of the output projection
  (from the start of backward to its end) and of one block, plus that block's copy in the
  reduce dtype when it differs;
* **activations**: what autograd keeps for backward, :func:`layer_bytes_per_token` per block
  and token, plus the final norm's, plus, with activation checkpointing, one block's full set
  recomputed in its backward;
* **logits**: ``12 * vocab`` bytes a token of the microbatch: the loss upcasts the logits to
  fp32 and log-softmax keeps its fp32 output; at the start of backward that output, the
  gradient NLL gives it and the gradient it gives back are three fp32 [tokens, vocab] tensors.
  A loss in chunks (``loss_chunks``) holds them for one chunk's tokens at a time.

What a block keeps, per token, read off ``llama/transformer.py``'s ops (``d`` = dim, ``q`` =
n_heads * head_dim, ``kv`` = n_kv_heads * head_dim, ``H`` = ffn_hidden_dim, ``p`` = bytes of the
compute dtype, the rest fp32):

* without checkpointing, everything autograd saves: each of the two RMSNorms its fp32 input
  (``4d``; under fp32 compute that is the residual stream itself), its inverse RMS (4) and
  both its normalised output and that times the weight (``2pd``); attention the rotated
  queries and keys, the values and SDPA's output (``p(2q + 2kv)``; RoPE's complex product
  saves only the rotation table, the projections share the norm's output) and SDPA's fp32
  log-sum-exp (``4 * n_heads``); the SwiGLU its two projections, the SiLU and their product
  (``4pH``);
* ``full`` checkpointing: the block's input only (``pd``);
* ``selective`` by op: the block's input and the outputs of the seven matmuls and of SDPA
  (``p(3d + 2q + 2kv + 2H) + 4 * n_heads``), the elementwise ops being recomputed;
* ``selective`` by layer: every ``every``-th block as ``full``, the others as without.

Under pipeline parallelism (``pipeline``, a :class:`~plugtrain.model.memory.PipelineShare`)
the estimate is one pipeline rank's: its stages' blocks, the embedding where it holds the
first stage, the final norm, output and logits where it holds the last, sharded over the
``world_size / pp`` ranks of its stages; **gathered** is all its stages' parameters in the
compute dtype and their gradients in the reduce dtype, unsharded, as torch's ``PipelineStage``
keeps them from the first backward to the last microbatch's (no resharding after backward, no
gradient reduction before it); **activations** are the chunks the schedule keeps in flight
(``training.pipeline_plan`` says how many) times a stage's blocks; **logits** those of the
microbatches the last stage keeps (GPipe's all: the loss's saved fp32 log-softmax output,
``4 * vocab`` a token, for each but the one in backward; none with ``loss_chunks``, whose
chunks are recomputed).

Not counted: the CUDA context, NCCL's buffers, the allocator's fragmentation, gradients of
activations in flight during backward, ``torch.compile``'s buffers, and plugins' extra state
(EMA weights, a loss term's own copy of the logits): leave a margin for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from plugtrain.model.llama.args import ModelArgs
from plugtrain.model.memory import Checkpointing, MemoryEstimate, PipelineShare
from plugtrain.model.sharding import DTYPES, needs_sharding

__all__ = ["estimate_memory", "layer_bytes_per_token"]


def layer_bytes_per_token(args: ModelArgs, compute_bytes: int, mode: str, tp: int = 1) -> int:
    """Bytes one block keeps for backward per token, by checkpointing mode: ``none``,
    ``full`` or ``op`` (the module docstring derives each from the block's ops), on each of
    ``tp`` tensor-parallel ranks."""
    d, p, h = args.dim, compute_bytes, args.ffn_hidden_dim
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    if mode == "full":
        return p * d // tp
    if mode == "op":
        return (p * (3 * d + 2 * q + 2 * kv + 2 * h) + 4 * args.n_heads) // tp
    norms = 2 * (4 * d + 4 + 2 * p * d) // tp
    # Under tensor parallelism the two projections' inputs are the norms' outputs all-gathered
    # over the sequence: each rank keeps both whole.
    gathered = 2 * p * d if tp > 1 else 0
    return norms + gathered + (p * (2 * q + 2 * kv) + 4 * args.n_heads + 4 * p * h) // tp


def _root_params(args: ModelArgs) -> int:
    """The parameters outside the blocks: embedding, output (unless tied to it), final norm."""
    matrices = 1 if args.tie_embeddings else 2
    return matrices * args.vocab_size * args.dim + args.dim


def _block_params(args: ModelArgs) -> int:
    return (args.num_params() - _root_params(args)) // args.n_layers


def estimate_memory(
    args: ModelArgs,
    *,
    world_size: int,
    microbatch: int,
    seq_len: int,
    param_dtype: str,
    reduce_dtype: str,
    checkpointing: Checkpointing,
    dp_replicate: int = 1,
    tp: int = 1,
    loss_chunks: int = 1,
    layer_bytes: Callable[[Any, int, str, int], int] = layer_bytes_per_token,
    pipeline: PipelineShare | None = None,
) -> MemoryEstimate:
    """The bytes each of ``world_size`` processes holds at a step's peak, training ``args`` on
    microbatches of ``microbatch`` sequences of ``seq_len`` tokens (dtypes by config name); the
    model is sharded over ``world_size / dp_replicate`` of them (HSDP keeps that many copies).

    Under tensor parallelism (``tp > 1``) those ranks are ``tp`` splitting each tensor times
    the FSDP ranks sharding the splits (the norms, replicated over ``tp``, are counted split
    too: a few vectors); FSDP gathers the splits only; the activations and logits of a
    microbatch are split over ``tp`` but for the norms' all-gathered outputs. The loss computed
    in ``loss_chunks`` chunks of tokens holds one chunk's logits at a time. ``layer_bytes``
    is :func:`layer_bytes_per_token`'s counterpart for another family sharing this formula
    (``model.moe``'s blocks keep other activations). ``pipeline``: the estimate of that
    pipeline rank (the module docstring)."""
    p, r = DTYPES[param_dtype].itemsize, DTYPES[reduce_dtype].itemsize
    tokens, pp = microbatch * seq_len, 1 if pipeline is None else pipeline.pp
    dtypes = DTYPES[param_dtype], DTYPES[reduce_dtype]
    block, out_proj = _block_params(args), args.vocab_size * args.dim
    n, in_flight, last, logits_kept = _share(args, pipeline)
    sharded = tp > 1 or needs_sharding(world_size // pp, *dtypes)
    ranks = world_size // pp // dp_replicate if sharded else 1
    model = "model" if pipeline is None else "rank's stages"
    where = f"fp32, 1/{ranks} of the {model} each" if sharded else "fp32, not sharded"
    gathered, gathers = 0, needs_sharding(world_size // pp // tp, *dtypes)
    what = f"unsharded {param_dtype} root and 2 blocks, gradients of the output and a block"
    if gathers and pipeline is not None:
        gathered = (p + r) * n // tp
        what = f"its stages unsharded in {param_dtype}, gradients in {reduce_dtype}"
    elif gathers:
        gathered = p * (_root_params(args) + 2 * block + out_proj + block)
        gathered += r * block if r != p else 0
        gathered //= tp
    per_layer = {m: layer_bytes(args, p, m, tp) for m in ("none", "full", "op")}
    if checkpointing.mode == "layer":
        full = in_flight // checkpointing.every
        kept = full * per_layer["full"] + (in_flight - full) * per_layer["none"]
    else:
        kept = in_flight * per_layer[checkpointing.mode]
    recompute = 0 if checkpointing.mode == "none" else per_layer["none"]
    final_norm = (4 * args.dim + 4 + 2 * p * args.dim) // tp if last else 0
    logits_kept = logits_kept if loss_chunks == 1 else 1  # chunks are recomputed
    logits = math.ceil(tokens / loss_chunks) * args.vocab_size * 12 // tp if last else 0
    logits += (logits_kept - 1) * tokens * args.vocab_size * 4 // tp
    return MemoryEstimate(
        parts=(
            ("parameters", math.ceil(n / ranks) * 4, where),
            ("gradients", math.ceil(n / ranks) * 4, where),
            ("optimizer", math.ceil(n / ranks) * 8, "AdamW's two moments, " + where),
            ("gathered", gathered, what if sharded else "none: the model is not sharded"),
            (
                "activations",
                tokens * (kept + final_norm + recompute),
                f"{in_flight} blocks x {tokens} tokens, {checkpointing.describe()}",
            ),
            (
                "logits",
                logits,
                _logits_text(last, logits_kept, loss_chunks, tp),
            ),
        ),
        setting=_setting(world_size, tp, pipeline)
        + f", microbatch {microbatch} x {seq_len} tokens, {param_dtype} compute",
    )


def _share(args: ModelArgs, pipeline: PipelineShare | None) -> tuple[int, int, bool, int]:
    """The parameters a process holds, the blocks whose activations it keeps, whether it holds
    the last stage, and the microbatches' logits it keeps: the whole model's without a
    pipeline, else its stages' blocks, the embedding on the first and the norm and output on
    the last."""
    if pipeline is None:
        return args.num_params(), args.n_layers, True, 1
    per_stage, out_proj = args.n_layers // pipeline.num_stages, args.vocab_size * args.dim
    n = per_stage * len(pipeline.stages) * _block_params(args)
    n += out_proj if pipeline.first else 0
    n += args.dim + (0 if args.tie_embeddings else out_proj) if pipeline.last else 0
    return n, per_stage * pipeline.in_flight, pipeline.last, pipeline.logits_in_flight


def _logits_text(last: bool, logits_kept: int, loss_chunks: int, tp: int) -> str:
    if not last:
        return "none: the loss is the last stage's"
    return (
        "3 fp32 [tokens, vocab] in the loss"
        + (f", and {logits_kept - 1} microbatches' log-softmax" if logits_kept > 1 else "")
        + (f", split over tp {tp}" if tp > 1 else "")
        + (f", one of {loss_chunks} chunks at a time" if loss_chunks > 1 else "")
    )


def _setting(world_size: int, tp: int, pipeline: PipelineShare | None) -> str:
    if pipeline is None:
        return f"{world_size} process(es)" + (
            f" (tp {tp} x {world_size // tp} data-parallel)" if tp > 1 else ""
        )
    pp, stages = pipeline.pp, ", ".join(map(str, pipeline.stages))
    layout = f"pp {pp}" + (f" x tp {tp}" if tp > 1 else "")
    return (
        f"{world_size} process(es) ({layout} x {world_size // pp // tp} data-parallel; "
        f"pipeline rank {pipeline.rank}, stages {stages})"
    )
