"""One matrix product of a training step, for MFU and the roofline: :class:`Gemm`.

Each family lists its step's products (``ModelSpec.gemms``); the roofline
(``observability.limits.matmul_seconds``) times them with torch's own kernels. Free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gemm"]


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
