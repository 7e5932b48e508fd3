"""The Llama family's model: a decoder-only transformer, with its init plan and KV cache.

The architecture is Llama 3's: pre-norm RMSNorm blocks, rotary position embeddings (RoPE),
grouped-query attention (computed in ``model.attention``, the variant ``ModelArgs.attention``
names), a SwiGLU feed-forward network and an output projection, untied unless
``ModelArgs.tie_embeddings``. Parameter names follow Meta's reference code and torchtitan
(``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.w1``, ...), and every
projection is its own ``nn.Linear`` (no fused QKV or gate/up matrix), so that a tensor-parallel
plan addresses each by name (``parallelize_module``: ``wq``/``wk``/``wv``/``w1``/``w3``
column-wise, ``wo``/``w2`` row-wise) and the forwards run unchanged on the shards: they read
the number of heads from the projected tensors, not from ``ModelArgs``.

The trainer builds the model on the meta device, applies FSDP2 ``fully_shard`` to every
``TransformerBlock`` in ``Transformer.layers`` and to the root, materialises the shards with
``to_empty`` and then initialises it from ``Transformer.init_plan`` (``model.init``), as
``Transformer.init_weights(seed)`` does. That gives bit-identical
full parameters whatever the sharding, so a 1-process and an N-process run start from the
same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from plugtrain.model.attention import attention_variant
from plugtrain.model.init import Fill, init_normal, init_ones, init_trunc_normal, initialize
from plugtrain.model.llama.args import FLAVORS, ModelArgs, RopeScaling

T = TypeVar("T")

__all__ = [
    "FLAVORS",
    "KVCache",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "precompute_freqs_cis",
    "rotate_pairs",
    "scale_rope_frequencies",
]


def scale_rope_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``inv_freq`` (RoPE's angular frequencies) under Llama 3.1's scaling.

    Hugging Face's ``_compute_llama3_parameters`` and Meta's ``apply_scaling``: wavelengths
    ``2 pi / f`` above ``original / low_freq_factor`` are divided by ``factor``, those below
    ``original / high_freq_factor`` kept, and those between interpolated by where
    ``original / wavelength`` lies between the two factors.
    """
    wavelen = 2 * math.pi / inv_freq
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(
        wavelen > scaling.original_max_seq_len / low, inv_freq / scaling.factor, smoothed
    )
    return torch.where(wavelen < scaling.original_max_seq_len / high, inv_freq, scaled)


def precompute_freqs_cis(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """RoPE rotations ``exp(i * pos * theta^(-2k/head_dim))``, complex64 [max_seq_len, head_dim/2],
    the frequencies scaled by :func:`scale_rope_frequencies` when ``scaling`` is given.

    Computed in float64 on the CPU, so every device and every process gets the same table.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = scale_rope_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2k, 2k+1) of ``x`` [B, S, heads, head_dim] by ``freqs_cis``.

    ``freqs_cis`` is [S, head_dim/2] (a slice of ``precompute_freqs_cis``, shared by the rows),
    or [B, S, head_dim/2] (its rows at each token's own position: per-document positions).

    Meta's convention (adjacent pairs, not the rotate-half layout of Hugging Face). The rotation
    runs in float32 whatever the activation dtype, then casts back. Eagerly it is one complex
    multiplication (one kernel); under ``torch.compile`` it is :func:`rotate_pairs`, the same
    products in real arithmetic, bitwise equal, which inductor fuses with the projections
    around it (it generates no code for complex operators and would fall back to eager).
    """
    if torch.compiler.is_compiling():
        return rotate_pairs(x, freqs_cis)
    x_c = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    freqs = freqs_cis[None, :, None, :] if freqs_cis.dim() == 2 else freqs_cis[:, :, None, :]
    rotated = torch.view_as_real(x_c * freqs).flatten(-2)
    return rotated.type_as(x)


def rotate_pairs(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary_emb` in real arithmetic: each pair ``(a, b)`` and rotation
    ``c + i s`` give ``(a c - b s, a s + b c)``, the products and sums of the complex
    multiplication ``(a + ib)(c + is)``, in its order, so the result is bitwise the same."""
    real = torch.view_as_real(freqs_cis)
    cos, sin = (real[None, :, None, :] if freqs_cis.dim() == 2 else real[:, :, None, :]).unbind(-1)
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel scale.

    Normalises in float32 and casts back before the scale, as Meta's Llama does, so that
    bf16/fp16 activations (FSDP2 mixed precision) do not lose precision in the mean of squares.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)
        return normed * self.weight


class KVCache:
    """The keys and values of every layer, for inference: ``Transformer.forward(tokens, cache)``.

    Holds each layer's keys and values after RoPE and before the grouped-query repeat,
    ``[max_batch, n_kv_heads, max_seq_len, head_dim]``, allocated at the layer's first forward
    in its activations' dtype and device. :attr:`length` positions are filled; a forward of
    ``S`` tokens writes positions ``length .. length + S - 1`` and then advances it, so a
    prefill of the prompt followed by one-token decode steps attends as one causal forward
    over the whole sequence would.
    """

    def __init__(self, args: ModelArgs, max_batch: int, max_seq_len: int | None = None) -> None:
        self.max_batch = max_batch
        self.max_seq_len = args.max_seq_len if max_seq_len is None else max_seq_len
        self.length = 0
        """Positions filled so far: where the next forward's tokens go."""
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * args.n_layers

    def store(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer_id``'s new keys and values ``[B, n_kv_heads, S, head_dim]`` at
        :attr:`length`; return all of its keys and values so far, ``[B, n_kv_heads,
        length + S, head_dim]``."""
        batch, n_kv, seq, head_dim = k.shape
        end = self.length + seq
        if batch > self.max_batch or end > self.max_seq_len:
            raise ValueError(
                f"KVCache holds {self.max_batch} x {self.max_seq_len} positions; a forward of "
                f"{batch} x {seq} tokens after {self.length} does not fit: make a larger cache"
            )
        if self.layers[layer_id] is None:
            shape = (self.max_batch, n_kv, self.max_seq_len, head_dim)
            self.layers[layer_id] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self.layers[layer_id]
        keys[:batch, :, self.length : end] = k
        values[:batch, :, self.length : end] = v
        return keys[:batch, :, :end], values[:batch, :, :end]


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention, without biases.

    The projections are here; the attention itself is ``model.attention``'s variant.
    """

    def __init__(self, args: ModelArgs, layer_id: int = 0, qk_norm: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        # The model's head counts; under tensor parallelism a rank holds a share of them,
        # which forward reads from the projections' outputs.
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.attend = attention_variant(args.attention)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Qwen3's RMSNorm over each head's channels of the queries and keys, before RoPE
        # (the moe family's); Llama has none.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` [B, S, dim]; ``mask`` is the variant's for this forward (its ``mask``)."""
        batch, seq, _ = x.shape
        # -1 heads: a column-wise shard of wq, wk, wv holds this rank's heads only.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_emb(q, freqs_cis).transpose(1, 2)  # [B, heads, S, head_dim]
        k = apply_rotary_emb(k, freqs_cis).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.store(self.layer_id, k, v)
        out = self.attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``, of width ``dim`` and hidden size ``hidden``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``.

    The unit the trainer shards with FSDP2 ``fully_shard``.
    """

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The optional arguments by keyword: a tensor-parallel plan's PrepareModuleInput
        # for the attention then lays out the two positional ones only.
        h = x + self.attention(self.attention_norm(x), freqs_cis, cache=cache, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_plan(self) -> list[tuple[nn.Parameter, Fill]]:
        """(parameter, how to fill it) for every parameter of the block, in a fixed order.

        The projections that write into the residual stream (wo, w2) get a std that
        shrinks with depth, 0.02 / sqrt(2 * (layer_id + 1)) (torchtitan's depth_init), so the
        residual stream's variance does not grow with the number of layers at init.
        """
        out_std = 0.02 / math.sqrt(2 * (self.layer_id + 1))
        attn, ffn = self.attention, self.feed_forward
        return [
            (self.attention_norm.weight, init_ones),
            (attn.wq.weight, init_trunc_normal(0.02)),
            (attn.wk.weight, init_trunc_normal(0.02)),
            (attn.wv.weight, init_trunc_normal(0.02)),
            (attn.wo.weight, init_trunc_normal(out_std)),
            (self.ffn_norm.weight, init_ones),
            (ffn.w1.weight, init_trunc_normal(0.02)),
            (ffn.w3.weight, init_trunc_normal(0.02)),
            (ffn.w2.weight, init_trunc_normal(out_std)),
        ]


class Transformer(nn.Module):
    """Llama-style decoder: token embedding, ``n_layers`` blocks, final RMSNorm, output head.

    ``forward(tokens [B, S]) -> logits [B, S, vocab_size]`` in the activation dtype (the
    parameter dtype, or FSDP2's ``param_dtype``); compute the loss in float32. ``documents``
    [B, S] (``MicroBatch.documents``) gives the attention variant each token's document, and
    ``positions`` [B, S] each token's RoPE position (default ``0 .. S-1`` in every row;
    ``MicroBatch.positions`` restarts them at each document). For inference,
    ``forward(tokens, cache)`` with a :class:`KVCache` takes ``tokens`` as the positions after
    those the cache holds, and appends theirs (call it under ``torch.no_grad``). Both build
    the attention variant's mask once and hand it to every block. ``forward(tokens,
    head=head)`` returns ``head(h, project)`` instead of the logits, ``h`` the final norm's
    output and ``project`` (:meth:`project`) what makes logits of it: a loss that never holds
    the full logits (``model.loss.ChunkedLoss``) runs inside the forward, where FSDP2 has the
    output projection gathered.

    Build on any device (including meta) and then call ``init_weights(seed)``; the constructor's
    own initialisation is PyTorch's default and is not meant to be trained from.

    A pipeline stage (``model.llama.pipeline.pipeline_split``) is this model with some of its
    modules None: without ``tok_embeddings``, ``tokens`` is the previous stage's hidden states
    [B, S, dim]; without ``norm`` (and ``output``), forward returns the last block's hidden
    states. ``layers`` is keyed by block index ("0" .. "n_layers-1"), so a stage's blocks keep
    the whole model's names.
    """

    block_type: Callable[[int, ModelArgs], nn.Module] = TransformerBlock
    """Builds block ``i`` of a shape: a family that shares this decoder (``model.moe``) and
    differs in its blocks subclasses it with its own."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # The layers' attention variant, whose per-forward mask forward builds once.
        self.attend = attention_variant(args.attention)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by index, not a ModuleList: a pipeline stage that holds some of the blocks
        # keeps their names (layers.5...), hence its checkpoint keys and plans by name.
        self.layers = nn.ModuleDict(
            {str(i): self.block_type(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.sequence_shards = 1
        """The ranks the hidden states between blocks are split over by position: the tensor
        parallel degree (sequence parallelism), set by the TP plan; a pipeline stage given
        hidden states counts the sequence's positions from their share."""
        # Tied: no module at all, so that the model has one parameter where FSDP2, DCP,
        # to_empty and init_weights each see one tensor (a module sharing the Parameter would be
        # untied by to_empty from meta, and saved twice).
        self.output = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        # Non-persistent (not in state_dict, hence not in checkpoints) because it is a
        # pure function of args; init_weights recomputes it after to_empty. It is complex so
        # that FSDP2's MixedPrecisionPolicy, which casts floating-point forward inputs of every
        # sharded block to param_dtype, leaves it in full precision.
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
            ),
            persistent=False,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], T] | None = None,
    ) -> torch.Tensor | T:
        start = 0 if cache is None else cache.length
        seq_len = tokens.shape[1]
        if self.tok_embeddings is None:  # a later pipeline stage's hidden states, maybe split
            seq_len *= self.sequence_shards
        if start + seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {start + seq_len} exceeds the model's max_seq_len "
                f"{self.args.max_seq_len}; shorten the sequences or raise ModelArgs.max_seq_len"
            )
        if not self.freqs_cis.is_complex():
            raise RuntimeError(
                f"the RoPE buffer freqs_cis was cast to {self.freqs_cis.dtype} (Module.to(dtype) "
                "casts complex buffers to real); call init_weights again or use FSDP2's "
                "MixedPrecisionPolicy instead of Module.to(dtype)"
            )
        if positions is None:
            freqs_cis = self.freqs_cis[start : start + seq_len]
        else:  # each token's rotation, [B, S, head_dim/2]: a gather, no host read
            freqs_cis = self.freqs_cis[positions]
        mask = self.attend.mask(tokens, start, documents)
        # A pipeline stage without the embedding is given the previous stage's hidden states.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, freqs_cis, cache=cache, mask=mask)
        if cache is not None:
            cache.length += seq_len
        if self.norm is None:  # a pipeline stage before the last: its hidden states
            return h
        h = self.norm(h)
        if head is not None:
            return head(h, self.project)
        return self.project(h)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the final norm's output ``hidden``: the output projection, or the
        embedding's matrix when tied."""
        if self.output is None:
            return F.linear(hidden, self.tok_embeddings.weight)
        return self.output(hidden)

    def kv_cache(self, max_batch: int, max_seq_len: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for ``max_batch`` sequences of this model (decoding's)."""
        return KVCache(self.args, max_batch, max_seq_len)

    def init_plan(self) -> list[tuple[nn.Parameter, Fill]]:
        """(parameter, how to fill it) for every parameter, in a fixed, sharding-free order.

        The embedding is N(0, 1) (Llama/torchtitan); the output projection gets std dim**-0.5
        so that the initial logits have about unit scale and the initial loss is near
        log(vocab_size). A tied embedding is drawn once, at the output's scale, for the same
        reason (the first block's RMSNorm rescales what it feeds the blocks).
        """
        out_std = self.args.dim**-0.5
        embedding = init_trunc_normal(out_std) if self.output is None else init_normal(1.0)
        plan: list[tuple[nn.Parameter, Fill]] = [(self.tok_embeddings.weight, embedding)]
        for layer in self.layers.values():
            plan.extend(layer.init_plan())
        plan.append((self.norm.weight, init_ones))
        if self.output is not None:
            plan.append((self.output.weight, init_trunc_normal(out_std)))
        return plan

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter and rebuild the RoPE buffer, deterministically from ``seed``.

        Gives bit-identical full parameters whether they are plain tensors or FSDP2-sharded
        DTensors (any mesh, any world size), and whether the model was built on the CPU or on
        the meta device and then ``to_empty``'d (``model.init.initialize`` says how). See
        ``init_plan`` for the distributions.
        """
        initialize(self, self.init_plan(), seed)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Rebuild the RoPE buffer (after ``to_empty``), for a model whose parameters are
        loaded rather than initialised; :meth:`init_weights` calls it."""
        args = self.args
        self.freqs_cis = precompute_freqs_cis(
            args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
        ).to(self.freqs_cis.device)
