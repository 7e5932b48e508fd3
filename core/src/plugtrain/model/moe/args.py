"""The moe family's shapes, the named sizes, and the FLOPs and matrix products of a step.

:class:`MoEArgs` is a Qwen3-MoE shape: Qwen3's attention (an explicit ``head_dim``, RMSNorm
over each head's queries and keys), blocks whose feed-forward network is a mixture of
``num_experts`` SwiGLU experts of which each token uses ``top_k`` (plus an optional shared
expert every token uses), and dense SwiGLU blocks where ``mlp_only_layers`` and
``decoder_sparse_step`` say. ``FLAVORS`` are the named ones.

FLOPs count the *active* parameters, those one token computes with (``top_k`` of the
experts), as MFU is reported for a mixture of experts; the parameter count is every one.

Free of torch, so that the config, and with it ``--help``, needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plugtrain.model.gemm import Gemm, attention_gemms, projection_gemms
from plugtrain.model.llama.args import RopeScaling

__all__ = ["FLAVORS", "MoEArgs"]


@dataclass(frozen=True)
class MoEArgs:
    """Shape hyper-parameters of a Qwen3-MoE-style transformer (frozen; derive a variant with
    ``dataclasses.replace``)."""

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``."""
    vocab_size: int
    """Rows of the embedding and of the output projection (the trainer sets the tokenizer's)."""
    num_experts: int
    """Routed experts in each mixture-of-experts block."""
    top_k: int
    """Experts each token is routed to (<= ``num_experts``)."""
    moe_ffn_dim: int
    """Hidden size of each routed expert's SwiGLU (Hugging Face's ``moe_intermediate_size``)."""
    head_dim: int = 0
    """Channels per attention head; 0: ``dim // n_heads``. Qwen3 sets it on its own, so that
    ``n_heads * head_dim`` may differ from ``dim``."""
    ffn_dim: int | None = None
    """Hidden size of the dense blocks' SwiGLU (Hugging Face's ``intermediate_size``); needed
    only if some block is dense (``mlp_only_layers``, ``decoder_sparse_step``)."""
    shared_ffn_dim: int = 0
    """Hidden size of a shared expert every token goes through beside its routed ones
    (DeepSeek's); 0: none (Qwen3-MoE has none)."""
    norm_topk_prob: bool = True
    """Renormalise each token's ``top_k`` router probabilities to sum to 1 (Qwen3-MoE)."""
    decoder_sparse_step: int = 1
    """Block ``i`` is a mixture of experts when ``(i + 1) % decoder_sparse_step == 0`` (and it
    is not in :attr:`mlp_only_layers`), else dense."""
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    """Blocks that are dense whatever :attr:`decoder_sparse_step` says."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """Base of the RoPE frequencies."""
    max_seq_len: int = 2048
    """Longest sequence the model accepts (the RoPE table's length)."""
    tie_embeddings: bool = False
    """The output projection is the token embedding's matrix."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's RoPE frequency scaling, or None."""
    attention: str = "sdpa"
    """The attention variant (``model.attention.VARIANTS``)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_experts", "top_k", "moe_ffn_dim", "decoder_sparse_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEArgs.top_k={self.top_k} exceeds num_experts={self.num_experts}: a token "
                "cannot be routed to more experts than there are; lower top_k"
            )
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"MoEArgs.dim={self.dim} is not divisible by n_heads={self.n_heads}: "
                    "set head_dim"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim < 1 or self.head_dim % 2:
            raise ValueError(
                f"MoEArgs.head_dim={self.head_dim} must be even and >= 2 (RoPE rotates pairs)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"MoEArgs.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}; choose n_kv_heads that divides n_heads"
            )
        if self.shared_ffn_dim < 0:
            raise ValueError(f"MoEArgs.shared_ffn_dim must be >= 0, got {self.shared_ffn_dim}")
        dense = [i for i in range(self.n_layers) if not self.is_moe_layer(i)]
        if dense and (self.ffn_dim is None or self.ffn_dim < 1):
            raise ValueError(
                f"MoEArgs: block {dense[0]} is dense (mlp_only_layers, decoder_sparse_step) but "
                f"ffn_dim is {self.ffn_dim}: set ffn_dim >= 1"
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id``'s feed-forward network is a mixture of experts (Hugging
        Face's rule)."""
        return (
            layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> int:
        """How many blocks are mixtures of experts."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of a dense block's SwiGLU (0 where no block is dense)."""
        return self.ffn_dim or 0

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        # wq, wo, wk, wv; q_norm and k_norm; attention_norm and ffn_norm.
        return d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 2 * hd + 2 * d

    def _moe_params(self, active: bool) -> int:
        experts = self.top_k if active else self.num_experts
        # The router's gate, the routed experts, the shared expert.
        return self.dim * self.num_experts + 3 * self.dim * (
            experts * self.moe_ffn_dim + self.shared_ffn_dim
        )

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Number of parameters of the model, from the shape alone; ``active``: only those a
        token computes with (``top_k`` of each block's experts). ``exclude_embedding`` leaves
        out the token embedding table (a tied one is the output projection, counted)."""
        moe = self.moe_layers
        blocks = self.n_layers * self._attention_params()
        blocks += moe * self._moe_params(active)
        blocks += (self.n_layers - moe) * 3 * self.dim * self.ffn_hidden_dim
        total = blocks + self.dim + self.vocab_size * self.dim  # final norm, output
        return (
            total
            if exclude_embedding or self.tie_embeddings
            else total + self.vocab_size * self.dim
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``: 6 per *active*
        non-embedding parameter (``top_k`` experts of each mixture-of-experts block, the
        router's gate whole) plus the attention's ``12 * n_layers * n_heads * head_dim *
        seq_len``, as Llama's (``ModelArgs.flops_per_token``) counts it."""
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * self.num_params(exclude_embedding=True, active=True) + attention

    def gemms(self, rows: int, seq_len: int) -> list[Gemm]:
        """The matrix products of one forward and backward of ``rows`` sequences of ``seq_len``,
        with the routed experts balanced: each of the ``num_experts`` multiplies ``tokens *
        top_k / num_experts`` rows (one grouped GEMM computes them all at once)."""
        d, hd, tokens, layers = self.dim, self.head_dim, rows * seq_len, self.n_layers
        moe, dense = self.moe_layers, self.n_layers - self.moe_layers
        per_expert = max(1, tokens * self.top_k // self.num_experts)
        projections = [
            ("wq", tokens, d, self.n_heads * hd, layers),
            ("wk", tokens, d, self.n_kv_heads * hd, layers),
            ("wv", tokens, d, self.n_kv_heads * hd, layers),
            ("wo", tokens, self.n_heads * hd, d, layers),
            ("router", tokens, d, self.num_experts, moe),
            ("experts.w1", per_expert, d, self.moe_ffn_dim, moe * self.num_experts),
            ("experts.w3", per_expert, d, self.moe_ffn_dim, moe * self.num_experts),
            ("experts.w2", per_expert, self.moe_ffn_dim, d, moe * self.num_experts),
            ("shared.w1", tokens, d, self.shared_ffn_dim, moe),
            ("shared.w3", tokens, d, self.shared_ffn_dim, moe),
            ("shared.w2", tokens, self.shared_ffn_dim, d, moe),
            ("w1", tokens, d, self.ffn_hidden_dim, dense),
            ("w3", tokens, d, self.ffn_hidden_dim, dense),
            ("w2", tokens, self.ffn_hidden_dim, d, dense),
            ("output", tokens, d, self.vocab_size, 1),
        ]
        out = []
        for name, m, fan_in, fan_out, count in projections:
            if count and fan_in and fan_out:
                out += projection_gemms(name, m, fan_in, fan_out, count)
        return out + attention_gemms(rows, seq_len, self.n_heads, hd, layers)


FLAVORS: dict[str, MoEArgs] = {
    # CPU tests and the debug run: a forward/backward of 8 x 128 tokens takes tens of ms.
    "debug_moe": MoEArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=64,
        max_seq_len=512,
    ),
    # Qwen3-30B-A3B (its config.json): 30.5B parameters, 3.3B active.
    "qwen3_30b_a3b": MoEArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        top_k=8,
        moe_ffn_dim=768,
        ffn_dim=6144,
        max_seq_len=40960,
    ),
}
