"""One matrix product of a training step, for MFU and the roofline: :class:`Gemm`.

Each family lists its step's products (``ModelSpec.gemms``), a projection's three and the
attention's six built here; the roofline (``observability.limits.matmul_seconds``) times them
with torch's own kernels. Free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gemm", "attention_gemms", "projection_gemms"]


@dataclass(frozen=True)
class Gemm:
    """One matrix product of a training step: ``batch`` products of ``(m, k)`` by ``(k, n)``."""

    name: str
    """What it computes: ``<weight>.forward``, ``<weight>.input_grad``, ``<weight>.weight_grad``
    for a projection, ``attention.<scores|values>.<pass>`` for the attention's products."""
    m: int
    n: int
    k: int
    batch: int = 1
    count: int = 1
    """How many times a step makes this product (once per layer for a block's)."""

    @property
    def flops(self) -> int:
        """Multiply-adds times two, over every product this stands for."""
        return 2 * self.count * self.batch * self.m * self.n * self.k


def projection_gemms(name: str, rows: int, fan_in: int, fan_out: int, count: int) -> list[Gemm]:
    """The three products of ``count`` projections ``y = x @ W.T`` of ``rows`` rows each
    (``W``: ``[fan_out, fan_in]``): the forward, the input's gradient and the weight's."""
    return [
        Gemm(f"{name}.forward", rows, fan_out, fan_in, count=count),
        Gemm(f"{name}.input_grad", rows, fan_in, fan_out, count=count),
        Gemm(f"{name}.weight_grad", fan_out, fan_in, rows, count=count),
    ]


def attention_gemms(rows: int, seq_len: int, heads: int, head_dim: int, layers: int) -> list[Gemm]:
    """The attention's six products in each of ``layers`` layers, for ``rows`` sequences of
    ``seq_len`` and ``heads`` query heads: scores ``Q @ K.T`` and values ``P @ V``, each
    forward and two backward, every query attending to every position."""
    batch = rows * heads
    return [
        Gemm("attention.scores.forward", seq_len, seq_len, head_dim, batch, layers),
        Gemm("attention.scores.query_grad", seq_len, head_dim, seq_len, batch, layers),
        Gemm("attention.scores.key_grad", seq_len, head_dim, seq_len, batch, layers),
        Gemm("attention.values.forward", seq_len, head_dim, seq_len, batch, layers),
        Gemm("attention.values.probs_grad", seq_len, seq_len, head_dim, batch, layers),
        Gemm("attention.values.value_grad", seq_len, head_dim, seq_len, batch, layers),
    ]
