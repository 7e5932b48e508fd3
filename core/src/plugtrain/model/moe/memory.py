"""The moe family's memory formula: Llama's (``model.llama.memory``) with its blocks' activations.

The parameters, gradients and AdamW's moments are every expert's (a token computes with
``top_k`` of them, but each is trained and held), and FSDP2 gathers a block with all its
experts; the activations are what one token keeps, which a mixture of experts multiplies by
``top_k`` in its routed part (``d`` = dim, ``q`` = n_heads * head_dim, ``kv`` = n_kv_heads *
head_dim, ``H`` = moe_ffn_dim, ``k`` = top_k, ``E`` = num_experts, ``p`` = bytes of the compute
dtype), averaged over the blocks (dense ones keep Llama's SwiGLU's ``4pH_dense``):

* without checkpointing: Llama's norms and attention (``2(4d + 4 + 2pd) + p(2q + 2kv) + 4 *
  n_heads``), the head norms of the queries and keys (their fp32 input, normalised output and
  that times the weight, ``(4 + 2p)(q + kv)``), the router's fp32 logits and probabilities
  (``8E``), and for each of the ``k`` copies of the token its gathered input, the SwiGLU's two
  projections, SiLU and product, the expert's output and its weighted copy (``pk(3d + 4H)``),
  plus a shared expert's SwiGLU (``4pH_shared``);
* ``full`` checkpointing: the block's input (``pd``);
* ``selective`` by op: the block's input and the matmuls' outputs (``p(2d + 2q + 2kv) +
  4 * n_heads + 4E + pk(2H + d)``, and ``p(2H_shared + ...)``).
"""

from __future__ import annotations

import functools

from plugtrain.model.llama.memory import estimate_memory as llama_estimate
from plugtrain.model.moe.args import MoEArgs

__all__ = ["estimate_memory", "layer_bytes_per_token"]


def layer_bytes_per_token(args: MoEArgs, compute_bytes: int, mode: str, tp: int = 1) -> int:
    """Bytes one block keeps for backward per token, averaged over the blocks, by
    checkpointing mode (``none``, ``full`` or ``op``: the module docstring); ``tp`` must be 1
    (the family has no tensor parallelism)."""
    d, p, k, e = args.dim, compute_bytes, args.top_k, args.num_experts
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    h, shared, dense = args.moe_ffn_dim, args.shared_ffn_dim, args.ffn_hidden_dim
    moe, layers = args.moe_layers, args.n_layers
    if mode == "full":
        return p * d
    if mode == "op":
        routed = 4 * e + p * k * (2 * h + d) + p * (2 * shared + d if shared else 0)
        ffn = (moe * routed + (layers - moe) * p * (2 * dense + d)) // layers
        return p * (2 * d + 2 * q + 2 * kv) + 4 * args.n_heads + ffn
    attention = 2 * (4 * d + 4 + 2 * p * d) + p * (2 * q + 2 * kv) + 4 * args.n_heads
    attention += (4 + 2 * p) * (q + kv)
    routed = 8 * e + p * k * (3 * d + 4 * h) + 4 * p * shared
    return attention + (moe * routed + (layers - moe) * 4 * p * dense) // layers


estimate_memory = functools.partial(llama_estimate, layer_bytes=layer_bytes_per_token)
"""``ModelSpec.memory`` of the moe family: Llama's formula with :func:`layer_bytes_per_token`."""
