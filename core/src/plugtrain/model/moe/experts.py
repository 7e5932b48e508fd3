"""A layer's routed experts: SwiGLU MLPs held as stacked weights, run as grouped GEMMs.

The tokens arrive sorted by expert, ``counts[e]`` rows for expert ``e`` in expert order, so
that one grouped matrix product (``F.grouped_mm`` with the experts' row offsets) computes every
expert at once, forward and backward. Where torch has no ``grouped_mm`` a loop over the experts
computes the same products (bitwise, on CPU), as it does for shapes the grouped kernel refuses
(float64, or rows not a multiple of 16 bytes) and, under ``torch.compile``, for dtypes other
than bf16. An expert given no token costs nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["GroupedExperts", "grouped_matmul"]

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (``[tokens, in]``, sorted by expert) times each expert's ``weight[e].T``
    (``weight``: ``[experts, out, in]``, as ``nn.Linear`` lays out one), ``[tokens, out]``.

    ``counts`` (int, ``[experts]``) is each expert's number of rows. What ``F.grouped_mm``
    cannot take (see the module doc) runs as a loop, which reads ``counts`` on the host.
    """
    # NOTE: under torch.compile (2.13) the kernel's fake implementation takes bf16 only.
    compiled_fp = torch.compiler.is_compiling() and x.dtype != torch.bfloat16
    grouped = HAS_GROUPED_MM and x.dtype != torch.float64 and not compiled_fp
    if grouped and _aligned(x.shape[-1], weight.shape[-2], x):
        offsets = counts.cumsum(0, dtype=torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    rows = x.split(counts.tolist())
    return torch.cat([r @ w.T for r, w in zip(rows, weight.unbind(), strict=True)])


def _aligned(inner: int, outer: int, x: torch.Tensor) -> bool:
    """Whether rows of ``inner`` and ``outer`` elements of ``x``'s dtype are whole multiples of
    16 bytes, as the grouped kernel's strides must be."""
    return inner * x.element_size() % 16 == 0 and outer * x.element_size() % 16 == 0


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs, ``w2_e(silu(w1_e x) * w3_e x)``, for tokens sorted by expert.

    ``w1`` and ``w3`` are ``[num_experts, hidden, dim]``, ``w2`` ``[num_experts, dim, hidden]``:
    expert ``e``'s ``gate_proj``, ``up_proj`` and ``down_proj`` weights as ``nn.Linear`` holds
    them, stacked. Expert parallelism shards the three over their first dimension, and the
    forward runs unchanged on the local experts.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            for expert in w.data.unbind():  # nn.Linear's default, with each expert's fan-in
                nn.init.kaiming_uniform_(expert, a=5**0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: ``[tokens, dim]``, ``counts[e]`` rows for each local expert ``e`` in order
        (``counts.sum() == tokens``); returns ``[tokens, dim]`` in the same order."""
        # Under expert parallelism the weights are DTensors split over the experts: the
        # products run on this rank's experts (``model/moe/expert_parallel.py``).
        weights = (self.w1, self.w2, self.w3)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in weights)
        gate = grouped_matmul(x, w1, counts)
        up = grouped_matmul(x, w3, counts)
        return grouped_matmul(F.silu(gate) * up, w2, counts)
