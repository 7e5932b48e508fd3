"""The [metrics] section: what the run logs and where."""

from __future__ import annotations

from dataclasses import dataclass

from plugtrain.errors import check_field, require_extra


@dataclass
class MetricsConfig:
    """What the run logs and where: console, metrics.jsonl, TensorBoard, W&B."""

    log_freq: int = 10
    """Log a metrics line every this many steps (and on the first and last step)."""
    enable_tensorboard: bool = False
    """Also write TensorBoard event files to ``<dump_folder>/tensorboard`` (extra: tensorboard)."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (extra: wandb); ``WANDB_MODE=offline`` needs no network."""
    wandb_project: str = "plugtrain"
    """The W&B project of the run (the run is named after the dump folder)."""
    trace_hooks: bool = False
    """Trace every hook call (plugins, order, time) to ``<dump_folder>/hook_trace.rank<N>.jsonl``
    and summarise per-plugin time at the end; ``PLUGTRAIN_TRACE_HOOKS=1`` or ``0`` overrides."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device for MFU; 0 looks the GPU up in a table of dense peaks by compute
    precision (A100, H100, H200, B200, GB200; no MFU on CPU or on a GPU it does not know)."""
    matmul_limit: bool = True
    """On CPU, time torch's matmuls at the step's GEMM shapes at start-up (rank 0, about two
    seconds for the debug model; nothing once cached, per machine and shape, in
    ``$PLUGTRAIN_CACHE/matmul_limits.json``) and log ``mfu_matmul_pct``: the step's model
    FLOP/s in percent of what those matmuls reach on this machine; a step that beats the limit
    is flagged (``mfu_matmul_over_100``) and has it re-timed. Off: no timing, no
    ``mfu_matmul_pct``."""
    log_all_ranks: bool = False
    """Log INFO from every rank, prefixed with its rank (by default only rank 0 does)."""
    moe_tokens_per_expert: bool = False
    """Family ``moe``: log every expert's tokens of the step, summed over ranks, as
    ``moe/tokens_per_expert.<block>.<expert>`` (blocks x experts values a record: 6144 for
    ``qwen3_30b_a3b``); off, each block's ``moe/imbalance``, ``max_tokens`` and ``min_tokens``
    only."""

    def __post_init__(self) -> None:
        check_field(self.log_freq >= 1, "log_freq", f"must be >= 1, got {self.log_freq}")
        check_field(self.peak_tflops >= 0, "peak_tflops", f"must be >= 0, got {self.peak_tflops}")
        if self.enable_tensorboard:
            require_extra("tensorboard", "tensorboard", "metrics.enable_tensorboard")
        if self.enable_wandb:
            require_extra("wandb", "wandb", "metrics.enable_wandb")
