"""The Llama family's shapes, the named sizes, and the FLOPs and matrix products of a step.

:class:`ModelArgs` is a shape, ``FLAVORS`` the named ones; ``ModelArgs.gemms`` lists the
matrix products (:class:`~plugtrain.model.gemm.Gemm`) a training step makes at a shape.

Apart from the model (``model.llama.transformer``) and free of torch, so that the config, and
with it ``--help``, needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plugtrain.model.gemm import Gemm, attention_gemms, projection_gemms


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face's ``rope_type = "llama3"``).

    Stretches the context a model was trained on: frequencies whose wavelength exceeds
    ``original_max_seq_len / low_freq_factor`` are divided by ``factor``, those shorter than
    ``original_max_seq_len / high_freq_factor`` are kept, those between are interpolated.
    The defaults are Llama 3.1's.
    """

    factor: float = 8.0
    """Division of the low frequencies."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_seq_len / low_freq_factor`` are scaled fully."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_seq_len / high_freq_factor`` are left alone."""
    original_max_seq_len: int = 8192
    """The context length the unscaled model was trained on."""

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_seq_len < 1:
            raise ValueError(
                f"RopeScaling needs factor > 0, low_freq_factor > 0 and original_max_seq_len "
                f">= 1, got {self}"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelArgs:
    """Shape hyper-parameters of a Llama-style transformer.

    Frozen so that the shared ``FLAVORS`` entries cannot be modified by accident; derive a
    variant with ``dataclasses.replace(args, vocab_size=...)``.
    """

    dim: int
    """Width of the residual stream (the embedding size)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; ``dim`` must be divisible by it (head_dim = dim // n_heads)."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``.
    Equal to ``n_heads`` gives plain multi-head attention, 1 gives multi-query attention."""
    vocab_size: int
    """Rows of the embedding and of the output projection; the trainer overrides it with the
    tokenizer's vocabulary size."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this (hardware-friendly shapes)."""
    ffn_dim_multiplier: float | None = None
    """Optional factor applied to the SwiGLU hidden size before rounding (Llama 3 8B: 1.3)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the RoPE frequencies (Llama 3: 500000)."""
    max_seq_len: int = 2048
    """Longest sequence the model accepts; the RoPE table is precomputed for this length."""
    ffn_dim: int | None = None
    """The SwiGLU hidden size exactly (Hugging Face's ``intermediate_size``); None derives it
    from ``multiple_of`` and ``ffn_dim_multiplier`` (see :attr:`ffn_hidden_dim`)."""
    tie_embeddings: bool = False
    """The output projection is the token embedding's matrix (Llama 3.2 1B/3B, SmolLM): the
    model then has no ``output`` module and one tensor serves both ends."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's RoPE frequency scaling, or None for plain RoPE."""
    attention: str = "sdpa"
    """How attention is computed: a name in ``model.attention.VARIANTS`` (``"sdpa"``: causal
    ``F.scaled_dot_product_attention``; ``"document"``: causal within each document)."""

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "multiple_of",
            "max_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelArgs.dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "choose n_heads that divides dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelArgs.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}; choose n_kv_heads that divides n_heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} is odd, but RoPE rotates pairs "
                "of channels; choose dim and n_heads so that head_dim is even"
            )
        if self.ffn_dim is not None and self.ffn_dim < 1:
            raise ValueError(f"ModelArgs.ffn_dim must be >= 1 or None, got {self.ffn_dim}")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(
                f"ModelArgs.ffn_dim_multiplier must be > 0 or None, got {self.ffn_dim_multiplier}"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of the SwiGLU feed-forward network: :attr:`ffn_dim` if set, else by
        Llama's rule.

        Two thirds of 4*dim (so SwiGLU's three matrices cost about what a 4*dim two-matrix MLP
        costs), times ``ffn_dim_multiplier`` if set, rounded up to a multiple of
        ``multiple_of``.
        """
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Number of parameters of ``Transformer(self)``, computed from the shape alone.

        ``exclude_embedding`` leaves out the token embedding table (a lookup, no matmul), which
        is the count that FLOP estimates use. The output projection is always counted; a tied
        one is the embedding's matrix, counted once.
        """
        d, hd = self.dim, self.head_dim
        attention = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # wq, wo, wk, wv
        feed_forward = 3 * d * self.ffn_hidden_dim  # w1, w2, w3
        per_layer = attention + feed_forward + 2 * d  # + attention_norm, ffn_norm
        total = self.n_layers * per_layer + d + self.vocab_size * d  # + norm, output
        return total if exclude_embedding or self.tie_embeddings else total + self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

        The usual estimate (PaLM appendix B, torchtitan): 6 FLOPs per non-embedding parameter
        per token for the matmuls (2 forward, 4 backward), plus 12 * n_layers * n_heads *
        head_dim * seq_len for the attention score and value matmuls. Causal masking is not
        discounted, matching how MFU is usually reported. Elementwise ops are not counted.
        """
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * self.num_params(exclude_embedding=True) + attention

    def gemms(self, rows: int, seq_len: int) -> list[Gemm]:
        """The matrix products of one forward and backward of ``rows`` sequences of ``seq_len``.

        Each projection ``y = x @ W.T`` makes three (forward, the input's gradient, the weight's),
        the attention six per layer (scores ``Q @ K.T`` and values ``P @ V``, each forward and
        two backward), with every query head attending to every position, as
        :meth:`flops_per_token` counts. Their FLOPs add up to ``flops_per_token(seq_len) * rows *
        seq_len`` less the ``6 * tokens`` per norm weight that the estimate also counts.
        """
        d, hd, tokens, layers = self.dim, self.head_dim, rows * seq_len, self.n_layers
        projections = [
            ("wq", d, self.n_heads * hd, layers),
            ("wk", d, self.n_kv_heads * hd, layers),
            ("wv", d, self.n_kv_heads * hd, layers),
            ("wo", self.n_heads * hd, d, layers),
            ("w1", d, self.ffn_hidden_dim, layers),
            ("w3", d, self.ffn_hidden_dim, layers),
            ("w2", self.ffn_hidden_dim, d, layers),
            ("output", d, self.vocab_size, 1),
        ]
        out = []
        for name, fan_in, fan_out, count in projections:
            out += projection_gemms(name, tokens, fan_in, fan_out, count)
        return out + attention_gemms(rows, seq_len, self.n_heads, hd, layers)


_LLAMA3_VOCAB = 128256

FLAVORS: dict[str, ModelArgs] = {
    # Unit tests: a forward/backward takes milliseconds.
    "tiny": ModelArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=16,
        max_seq_len=64,
    ),
    # Pipeline tests: tiny's blocks, four of them, which 2 and 4 stages divide.
    "tiny4": ModelArgs(
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=16,
        max_seq_len=64,
    ),
    # CPU default of `python train.py`: 3.5M parameters besides the embedding (vocab 2048).
    # Measured on 2 idle CPU cores, fp32, batch 8 x 128 tokens: forward+backward 0.16 s a step;
    # 100 steps with AdamW take 17 s in 1 process and 25 s in 2 FSDP2 processes (gloo), which
    # leaves room in the one-minute budget for evaluation and logging.
    "debug": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=2048,
        multiple_of=64,
        max_seq_len=512,
    ),
    # Llama 3.2 1B and 3B shapes (Meta's params.json), but with an untied output projection
    # and without the RoPE frequency scaling (`use_scaled_rope`) of the released checkpoints:
    # plugtrain trains from scratch at max_seq_len.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Llama 3 8B.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Llama 3 70B: past one 80 GB GPU's share under FSDP alone at long sequences; see
    # configs/llama3_70b.toml for tensor parallelism within each node.
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Llama 3.1 405B (Hugging Face's Meta-Llama-3.1-405B config.json: 16384 x 126 blocks,
    # intermediate 53248, 128 heads, 8 key/value heads), with Llama 3.1's RoPE scaling (the only
    # released 405B has it) and an 8192-token table (trained at 8192 first): too large for
    # FSDP and TP alone; configs/llama3_405b.toml pipelines it.
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000.0,
        max_seq_len=8192,
        rope_scaling=RopeScaling(),
    ),
}


def run_model_args(flavor: str, vocab_size: int, seq_len: int) -> ModelArgs:
    """The shape a run trains: flavor ``flavor`` with the tokenizer's ``vocab_size``, its RoPE
    table long enough for the run's ``seq_len``."""
    args = FLAVORS[flavor]
    return replace(args, vocab_size=vocab_size, max_seq_len=max(args.max_seq_len, seq_len))
