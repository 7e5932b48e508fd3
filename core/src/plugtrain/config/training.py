"""The [training], [optimizer] and [lr_scheduler] sections: the run's sizes, AdamW, the schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from plugtrain.errors import check_field

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class TrainingConfig:
    """The run's length, batch and sequence sizes, seed, precision and device."""

    steps: int = 200
    """Optimizer steps to train for."""
    batch_size: int = 8
    """Global batch in sequences per optimizer step, over all ranks and microbatches."""
    seq_len: int = 128
    """Tokens per sequence."""
    grad_accum_steps: int = 1
    """Microbatches accumulated per optimizer step on each rank."""
    seed: int = 0
    """Seeds weight init, data order, and Python's, NumPy's and torch's global generators
    (per rank, hashed from the seed and the rank): same seed, same losses."""
    mixed_precision_param: Dtype = "float32"
    """FSDP2 MixedPrecisionPolicy param_dtype: the dtype of forward and backward compute."""
    mixed_precision_reduce: Dtype = "float32"
    """FSDP2 MixedPrecisionPolicy reduce_dtype: the dtype of the gradient reduce-scatter."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; ``auto`` picks CUDA when available, else CPU (gloo)."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
            value = getattr(self, key)
            check_field(value >= 1, key, f"must be >= 1, got {value}")


@dataclass
class OptimizerConfig:
    """AdamW's settings."""

    lr: float = 3e-3
    """Peak learning rate of AdamW, reached after the warmup."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter but those ``no_decay`` names."""
    no_decay: list[str] = field(default_factory=list)
    """Parameters trained without weight decay: those whose name (``layers.0.ffn_norm.weight``)
    contains one of these strings, e.g. ``["norm", "embeddings", "output"]``. They form a
    second param group with ``weight_decay = 0``; empty (the default): one group, every
    parameter decayed. Each string must match a parameter (checked at start-up)."""

    def __post_init__(self) -> None:
        check_field(0 < self.lr < math.inf, "lr", f"must be finite and > 0, got {self.lr}")
        check_field(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"must be two numbers in [0, 1), got {self.betas}",
        )
        check_field(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        check_field(
            self.weight_decay >= 0,
            "weight_decay",
            f"must be >= 0, got {self.weight_decay}",
        )
        check_field(
            all(self.no_decay) and len(set(self.no_decay)) == len(self.no_decay),
            "no_decay",
            f"must be distinct non-empty name parts, got {self.no_decay}",
        )


@dataclass
class LRSchedulerConfig:
    """The learning-rate schedule: linear warmup, then decay to a floor."""

    warmup_steps: int = 20
    """Steps of linear warmup from ~0 to ``optimizer.lr``."""
    decay_type: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Shape of the decay from the peak to ``min_lr_ratio * lr`` at ``training.steps``:
    ``cosine`` and ``linear`` decay from the end of the warmup on, ``constant`` stays at the
    peak; ``wsd`` (warmup-stable-decay) stays at the peak, then decays over the last
    ``decay_steps`` steps, shaped by ``decay_shape``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_steps: int | None = None
    """``wsd`` only (and required there): the number of final steps the decay lasts."""
    decay_shape: Literal["1-sqrt", "linear", "cosine"] = "1-sqrt"
    """``wsd`` only: the decay's shape over its progress p from 0 to 1: ``1 - sqrt(p)``,
    ``1 - p`` or ``(1 + cos(pi p)) / 2``."""

    def __post_init__(self) -> None:
        check_field(
            self.warmup_steps >= 0,
            "warmup_steps",
            f"must be >= 0, got {self.warmup_steps}",
        )
        check_field(
            0 <= self.min_lr_ratio <= 1,
            "min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )
        if self.decay_type != "wsd":
            check_field(
                self.decay_steps is None,
                "decay_steps",
                f"applies to decay_type 'wsd' only, but decay_type is '{self.decay_type}': "
                "remove decay_steps or set decay_type = 'wsd'",
            )
            return
        check_field(
            self.decay_steps is not None,
            "decay_steps",
            "must be set when decay_type is 'wsd': the number of final steps the learning "
            "rate decays over",
        )
        check_field(self.decay_steps >= 1, "decay_steps", f"must be >= 1, got {self.decay_steps}")
