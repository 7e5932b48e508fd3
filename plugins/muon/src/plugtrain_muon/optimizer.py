"""The ``MuonAdamW`` optimizer: Muon on matrices, fused AdamW on the rest, veto on device.

Muon (Keller Jordan's) keeps a momentum buffer per matrix and steps each matrix along the
orthogonalised momentum (a stack of matrices, ``[experts, out, in]``, matrix by matrix),
computed by a Newton-Schulz iteration in bfloat16 (torch's; float32 on request). The
iteration is not elementwise: on an FSDP2 ``Shard(0)`` shard it would orthogonalise the rows
a rank holds, not the matrix. So each matrix's update, cast to the
iteration's dtype, is all-gathered over the shards, every rank runs the iteration on the full
matrix (the same bits on every rank), and keeps its own rows.

Why not ``torch.optim.Muon``: it reads a tensor learning rate with ``.item()`` (a host sync
every step), takes no ``found_inf`` (a device veto would cost another), and would run the
iteration on DTensor shards. This implementation follows its update rule operation by
operation, so that on unsharded tensors it gives the same bits (``tests/test_reference.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from plugtrain.plugin import local_tensor

AdjustLR = Literal["original", "match_rms_adamw"]

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""The quintic Newton-Schulz iteration's (a, b, c), as torch.optim.Muon's defaults."""


def orthogonalize(
    m: Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``m``'s nearest semi-orthogonal matrix, roughly (singular values in about [0.5, 1.5]),
    by ``steps`` quintic Newton-Schulz iterations in ``dtype``, on the wide orientation; of a
    stack ``[n, rows, cols]`` (a layer's experts), each matrix's, batched."""
    a, b, c = coefficients
    x = m.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # Spectral norm <= Frobenius norm <= 1, matrix by matrix.
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    multiply_add = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = multiply_add(gram, gram, gram, beta=b, alpha=c)
        x = multiply_add(x, poly, x, beta=a)
    return x.mT if tall else x


def lr_ratio(shape: torch.Size, adjust_lr_fn: AdjustLR) -> float:
    """The factor of a ``shape`` matrix's learning rate: ``original`` sqrt(max(1, rows/cols))
    keeps the update's RMS independent of the aspect; ``match_rms_adamw`` 0.2 sqrt(max(rows,
    cols)) matches AdamW's typical update RMS, so that AdamW's LR and weight decay carry over."""
    rows, cols = shape[-2], shape[-1]  # each matrix's, of a stack
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _full(update: Tensor, like: Tensor) -> Tensor:
    """The whole matrix of which ``update`` is ``like``'s local shard: all-gathered over the
    mesh dimensions ``like`` is sharded on, ``dp_shard`` and ``tp`` both (FSDP2 over TP's
    ``_StridedShard`` included; none for a plain tensor)."""
    if not isinstance(like, DTensor):
        return update
    shard = DTensor.from_local(
        update, like.device_mesh, like.placements, run_check=False, shape=like.shape,
        stride=like.stride(),
    )  # fmt: skip
    return shard.full_tensor()


def _own_rows(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``full``, laid out as ``like`` (a local slice: no collective)."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


class MuonAdamW(Optimizer):
    """Muon on the param groups marked ``muon``, fused AdamW (torch's) on the others.

    A Muon group holds 2-D parameters (or 3-D stacks of them) and ``lr`` (a 0-d tensor),
    ``weight_decay``, ``momentum``, ``nesterov``, ``ns_steps``, ``eps``; an AdamW group whatever
    ``torch.optim.AdamW`` takes. ``step()`` honours ``found_inf`` and ``grad_scale`` as a
    fused optimizer does for ``GradScaler`` (``_step_supports_amp_scaling``): with
    ``found_inf`` nonzero no parameter and no state changes, decided on the device with no
    host read. The state is one ``momentum_buffer`` per matrix (a DTensor like its parameter,
    so checkpoints reshard it) and AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``.
    ``ns_dtype`` is the Newton-Schulz iteration's dtype: bfloat16 as torch's ``Muon``, or
    float32, whose updates do not turn the last-bit differences of data-parallel gradients
    into whole bfloat16 steps (``tests/test_distributed.py``).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        muon_groups: Iterable[dict[str, Any]],
        adamw_groups: Iterable[dict[str, Any]],
        *,
        adjust_lr_fn: AdjustLR = "original",
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        muon_groups = [{**g, "muon": True} for g in muon_groups]
        for group in muon_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon takes matrices and stacks of them only, got shape {list(p.shape)}"
                    )
        # torch's AdamW fills in its defaults; its groups are this optimizer's AdamW groups.
        # There may be none: every trainable parameter a matrix (adapters on a frozen model).
        adamw_groups = [{**g, "muon": False} for g in adamw_groups]
        self._adamw = torch.optim.AdamW(adamw_groups, fused=True) if adamw_groups else None
        self.adjust_lr_fn, self.ns_coefficients = adjust_lr_fn, ns_coefficients
        self.ns_dtype = ns_dtype
        adamw_param_groups = [] if self._adamw is None else self._adamw.param_groups
        super().__init__([*muon_groups, *adamw_param_groups], defaults={})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        skip = None if found_inf is None else found_inf > 0
        for group in self.param_groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_update(p, group, skip, grad_scale)
        if self._adamw is None:
            return loss
        # The groups and state are looked up at each step: loading a state dict replaces them.
        self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw.state = self.state
        self._adamw.found_inf, self._adamw.grad_scale = found_inf, grad_scale  # type: ignore[attr-defined]
        self._adamw.step()
        return loss

    def _muon_update(
        self, p: Tensor, group: dict[str, Any], skip: Tensor | None, grad_scale: Tensor | None
    ) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grad, buf, param = (local_tensor(t) for t in (p.grad, state["momentum_buffer"], p))
        if grad_scale is not None:
            grad = grad / grad_scale
        momentum, lr = group["momentum"], group["lr"]
        new_buf = buf.lerp(grad, 1 - momentum)
        update = grad.lerp(new_buf, momentum) if group["nesterov"] else new_buf
        # Cast before the gather: exact either way, and bfloat16 halves the bytes.
        full = _full(update.to(self.ns_dtype), like=p)
        ortho = orthogonalize(
            full, self.ns_coefficients, group["ns_steps"], group["eps"], self.ns_dtype
        )
        ortho = _own_rows(ortho, like=p)
        # In float64, rounded to float32 by the kernels: the bits of torch's Python scalars.
        new_param = param * (1 - lr.double() * group["weight_decay"])
        new_param.addcmul_(
            ortho.float(), (-lr.double() * lr_ratio(p.shape, self.adjust_lr_fn)).float()
        )
        if skip is None:
            buf.copy_(new_buf)
            param.copy_(new_param)
        else:
            buf.copy_(torch.where(skip, buf, new_buf))
            param.copy_(torch.where(skip, param, new_param))
