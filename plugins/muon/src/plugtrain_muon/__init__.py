"""plugtrain plugin: train the hidden matrices with Muon and the rest with AdamW.

It builds the run's optimizer (the ``build_optimizer`` hook): a :class:`MuonAdamW` whose first
param group is every 2-D parameter but the embedding and the output projection, and every
stack of matrices (a layer's routed experts, ``[experts, out, in]``, each expert's matrix
orthogonalised on its own), trained with Muon at ``muon.lr``; the embedding, the output
projection and the norms go to fused AdamW with the core's ``[optimizer]`` settings (and its
``no_decay`` parts, without weight decay). The LR schedule scales both by the same factor.
Under FSDP2, HSDP, tensor and expert parallelism each matrix's Newton-Schulz iteration runs on
the whole matrix (see :mod:`plugtrain_muon.optimizer`). Under pipeline parallelism each rank
builds it over its stages' parameters, whose meshes leave ``pp`` out: every matrix is gathered
whole within its stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from plugtrain.plugin import OptimizerContext, check_field, hookimpl
from plugtrain_muon.optimizer import AdjustLR, MuonAdamW, lr_ratio, orthogonalize

__all__ = ["MuonAdamW", "MuonConfig", "MuonPlugin", "lr_ratio", "orthogonalize"]


NSDtype = Literal["bfloat16", "float32"]


@dataclass
class MuonConfig:
    lr: float = 0.02
    """Peak learning rate of the Muon matrices (the AdamW parameters use ``optimizer.lr``)."""
    momentum: float = 0.95
    """Muon's momentum, in [0, 1)."""
    nesterov: bool = True
    """Step along the Nesterov look-ahead of the momentum."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the Muon matrices, scaled by their (unadjusted) LR."""
    ns_steps: int = 5
    """Newton-Schulz iterations per matrix and step."""
    eps: float = 1e-7
    """Floor of the norm the iteration divides by first."""
    adjust_lr_fn: AdjustLR = "original"
    """How each matrix's LR is scaled by its shape: ``original`` (Keller Jordan's),
    sqrt(max(1, rows / cols)); ``match_rms_adamw`` (Moonshot's), 0.2 sqrt(max(rows, cols)),
    for which AdamW's LR and weight decay carry over."""
    ns_dtype: NSDtype = "bfloat16"
    """Dtype of the Newton-Schulz iteration and of its all-gather: ``bfloat16`` (torch's
    ``Muon``); ``float32`` keeps 2 and 4 data-parallel processes within fp32 rounding of 1
    (bfloat16 rounds their gradients' last-bit differences to whole bfloat16 steps) for
    twice the gather bytes and, on accelerators, slower matmuls."""
    adamw_params: list[str] = field(default_factory=lambda: ["tok_embeddings", "output"])
    """Parts of the names of matrices trained with AdamW, not Muon (the embedding and the
    output projection: Muon is for hidden matrices). Vectors always are."""

    def __post_init__(self) -> None:
        check_field(0 < self.lr < math.inf, "lr", f"must be finite and > 0, got {self.lr}")
        check_field(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        check_field(
            self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}"
        )
        check_field(
            1 <= self.ns_steps < 100, "ns_steps", f"must be in [1, 99], got {self.ns_steps}"
        )
        check_field(self.eps > 0, "eps", f"must be > 0, got {self.eps}")


class MuonPlugin:
    """Builds the :class:`MuonAdamW` optimizer over the model's named parameters."""

    @hookimpl
    def config_section(self) -> type:
        return MuonConfig

    @hookimpl
    def build_optimizer(self, ctx: OptimizerContext) -> MuonAdamW:
        cfg: MuonConfig = ctx.plugin_config(self)
        core = ctx.optimizer_config
        matrices, decayed, exempt = [], [], []
        for name, p in ctx.named_parameters:
            if p.ndim in (2, 3) and not any(part in name for part in cfg.adamw_params):
                matrices.append(p)
            elif any(part in name for part in core.no_decay):
                exempt.append(p)
            else:
                decayed.append(p)
        muon = {
            "params": matrices,
            "lr": ctx.learning_rate(cfg.lr),
            "weight_decay": cfg.weight_decay,
            "momentum": cfg.momentum,
            "nesterov": cfg.nesterov,
            "ns_steps": cfg.ns_steps,
            "eps": cfg.eps,
        }
        adamw = {"betas": tuple(core.betas), "eps": core.eps}
        adamw_groups = [
            {**adamw, "params": ps, "lr": ctx.learning_rate(core.lr), "weight_decay": wd}
            for ps, wd in ((decayed, core.weight_decay), (exempt, 0.0))
            if ps
        ]
        return MuonAdamW(
            [muon],
            adamw_groups,
            adjust_lr_fn=cfg.adjust_lr_fn,
            ns_dtype=getattr(torch, cfg.ns_dtype),
        )
