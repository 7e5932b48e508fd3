"""The Llama family's tensor parallelism (``parallelism.tp``): accepted degrees, the plan.

The plan is Megatron's, as torchtitan applies it: in every block ``wq``, ``wk``, ``wv``, ``w1``
and ``w3`` are split column-wise (each rank holds ``heads / tp`` query heads and ``kv_heads /
tp`` key/value heads, so grouped-query attention's groups stay whole on a rank, and
``hidden / tp`` of the SwiGLU's units), ``wo`` and ``w2`` row-wise; the norms run sequence
parallel (each rank normalises ``seq_len / tp`` of the tokens, and the activations between the
blocks stay split by position); the embedding is split by vocabulary rows, and the output
projection column-wise with its logits left sharded over the vocabulary, for
``loss_parallel``'s cross-entropy (no rank ever holds the full ``vocab`` logits; the loss in
chunks, ``model.loss.ChunkedLoss``, keeps them sharded chunk by chunk); tied, the one matrix
has both splits, which are the same rows. The
forwards run unchanged: they read their local head counts from the projections' outputs.
Inference on such a model (decoding, scoring) goes through
``model.tensor_parallel.whole_logits``.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from plugtrain.errors import ConfigError
from plugtrain.model.llama.args import ModelArgs
from plugtrain.model.llama.transformer import Transformer

__all__ = ["check_tensor_parallel", "parallelize", "plan"]


def check_tensor_parallel(args: ModelArgs, tp: int, seq_len: int) -> None:
    """Refuse, in one line naming the values, a model that ``tp`` ranks cannot split evenly.

    Document masking needs nothing more: its mask is per token, built once per forward from
    the whole positions and shared by each rank's heads, as RoPE's per-token positions are."""
    if tp == 1:
        return
    sizes = {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.n_kv_heads,
        "the FFN hidden size (model.ffn_dim)": args.ffn_hidden_dim,
        "training.seq_len": seq_len,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"parallelism.tp = {tp} does not divide {name} = {size}: choose a tp that "
                f"divides it (heads {args.n_heads}, key/value heads {args.n_kv_heads}, FFN "
                f"{args.ffn_hidden_dim}, seq_len {seq_len})"
            )


def plan(n_layers: int) -> dict[str, ParallelStyle]:
    """The parallel style of every module of an ``n_layers`` model, by fully qualified name."""
    styles: dict[str, ParallelStyle] = {
        # Vocabulary rows split; each rank's partial embeddings are summed and split by position.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Logits stay a DTensor sharded over the vocabulary, for loss_parallel.
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for i in range(n_layers):
        block = f"layers.{i}"
        styles |= {
            f"{block}.attention_norm": SequenceParallel(),
            # The positions are all-gathered before the projections (RoPE and causal attention
            # need every position); freqs_cis is a plain tensor, left as it is.
            f"{block}.attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            f"{block}.attention.wq": ColwiseParallel(),
            f"{block}.attention.wk": ColwiseParallel(),
            f"{block}.attention.wv": ColwiseParallel(),
            f"{block}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"{block}.ffn_norm": SequenceParallel(),
            f"{block}.feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            f"{block}.feed_forward.w1": ColwiseParallel(),
            f"{block}.feed_forward.w3": ColwiseParallel(),
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    return styles


def parallelize(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Apply :func:`plan` to ``model`` (unsharded, on the meta device) over ``tp_mesh``: every
    parameter becomes a DTensor over it, sharded or (the norms) replicated.

    Tied embeddings need nothing more of the weight: the embedding's split by vocabulary rows
    is ``Shard(0)``, exactly the output projection's column-wise split of the same ``vocab x
    dim`` matrix, so the one parameter serves both (its gradient sums the two uses' ``Shard(0)``
    parts). What the missing ``output`` module's style did to its input is done on the final
    norm's output instead: its positions are all-gathered, so that the product with the
    vocabulary-split matrix gives logits split over the vocabulary, for ``loss_parallel``."""
    styles = plan(model.args.n_layers)
    model.sequence_shards = tp_mesh.size()
    if model.output is None:
        del styles["output"]
    parallelize_module(model, tp_mesh, styles)
    if model.output is None:
        gather = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
        )
        parallelize_module(model.norm, tp_mesh, gather)
