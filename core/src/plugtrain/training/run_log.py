"""What a run says: its log lines at the start and the stop, and each logging step's record.

The record (``metrics.jsonl`` and the sinks) holds the step's loss and learning rate, the
plugins' ``step_metrics`` and loss terms, throughput and MFU (against the device's peak, or on
CPU the time the step's GEMMs alone take), the step's phase times, peak memory and the vetoed
steps; a mixture adds its sources' shares.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from plugtrain.config import JobConfig
from plugtrain.data import MixtureDataset, PackedDataset
from plugtrain.distributed import ParallelDims, all_reduce_mean
from plugtrain.model import ModelArgs, ModelSpec
from plugtrain.observability import (
    MatmulLimit,
    peak_memory_gib,
    peak_tflops,
    throughput,
    to_number,
)
from plugtrain.training.estimate import estimate_run
from plugtrain.training.loss_terms import LossTerms
from plugtrain.training.optim import describe_param_groups
from plugtrain.training.vetoes import Vetoes

logger = logging.getLogger("plugtrain")


class RunLog:
    """The log lines and step records of a run of ``spec``'s model of ``model_args`` on this
    rank of ``dims``; only rank 0 logs metrics, so only it looks up the limits MFU is measured
    against."""

    def __init__(
        self,
        config: JobConfig,
        dims: ParallelDims,
        spec: ModelSpec,
        model_args: ModelArgs,
        dtype: torch.dtype,
    ) -> None:
        self.config, self.dims, self.spec, self.model_args = config, dims, spec, model_args
        self.peak_tflops = (
            peak_tflops(dims.device, dtype, config.metrics.peak_tflops) if dims.is_main else None
        )
        self.matmul_limit = self._matmul_limit(dtype) if dims.is_main else None

    def _matmul_limit(self, dtype: torch.dtype) -> MatmulLimit | None:
        """The matmul limit of one of this rank's steps on this device, cached or timed
        (``metrics.matmul_limit``): on a GPU, beside its peak."""
        train_cfg, device = self.config.training, self.dims.device
        if not self.config.metrics.matmul_limit:
            return None
        accum = train_cfg.grad_accum_steps
        rows = train_cfg.batch_size // (self.dims.world_size * accum)
        gemms = self.spec.gemms(self.model_args, rows, train_cfg.seq_len)
        try:
            return MatmulLimit(gemms, device, dtype, scale=accum)
        except torch.OutOfMemoryError:
            logger.warning(
                "mfu(mm) is not reported: timing the step's GEMMs ran out of memory (set "
                "metrics.matmul_limit = false to skip it)"
            )
            return None

    def complete(self, step: int) -> None:
        """Say that the run is complete at ``step`` before it starts."""
        logger.info(
            "the run in %s is already complete at step %d: nothing to do (to train further, "
            "raise training.steps)",
            self.config.job.dump_folder,
            step,
        )

    def start(self, model: nn.Module, optimizer: torch.optim.Optimizer, builder: str) -> None:
        """Say what the run trains, the memory estimate of ``model`` (its trainable parameters)
        and its ``optimizer`` (who built it)."""
        cfg, dims = self.config, self.dims
        logger.info(
            "training %s (%.1fM parameters) for %d steps on %d %s process(es), %s compute",
            cfg.model.flavor,
            self.spec.num_params(self.model_args) / 1e6,
            cfg.training.steps,
            dims.world_size,
            dims.device.type,
            cfg.training.mixed_precision_param,
        )
        # A pipeline rank holds its stages only: the estimate is of the family's model, whole.
        whole = None if dims.pp_enabled else model
        estimate = estimate_run(cfg, dims.world_size, self.model_args.vocab_size, model=whole)
        logger.info("memory estimate per process: %s", estimate.summary())
        logger.info("optimizer (%s): %s", builder, describe_param_groups(optimizer))

    def stopped(self, step: int, cause: str) -> None:
        """Say that the run stopped after ``step`` on ``cause``, and how it goes on."""
        if step == self.config.training.steps:
            return  # the run is complete anyway
        if self.config.checkpoint.enable:
            then = "run the same command to resume"
        else:
            then = "checkpoint.enable is off, so nothing was saved and a rerun starts afresh"
        logger.info("stopped after step %d on %s; %s", step, cause, then)

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        lr: torch.Tensor,
        times: Mapping[str, float],
        step_metrics: Mapping[str, Mapping[str, float | int | torch.Tensor]],
        loss_terms: LossTerms | None,
        vetoes: Vetoes,
        train_data: PackedDataset | MixtureDataset,
    ) -> dict[str, float | int]:
        """Step ``step``'s record, read from the device (the one host sync of a logging step):
        its ``loss`` averaged over ranks, ``lr``, the plugins' ``step_metrics``, the loss terms,
        throughput, the phase ``times``, memory and the ``vetoes``."""
        world_size = self.dims.world_size
        global_loss = all_reduce_mean(loss, world_size)
        record = {"step": step, "loss": to_number(global_loss), "lr": to_number(lr)}
        for plugin, metrics in step_metrics.items():
            record.update({f"{plugin}/{k}": to_number(v) for k, v in metrics.items()})
        if loss_terms is not None:
            record.update(loss_terms.metrics(world_size))
        train_cfg = self.config.training
        record.update(
            throughput(
                train_cfg.batch_size * train_cfg.seq_len,
                times["time_step_s"],
                world_size,
                self.spec.flops_per_token(self.model_args, train_cfg.seq_len),
                self.peak_tflops,
                self.matmul_limit.against(times["time_step_s"]) if self.matmul_limit else None,
            ),
            **times,
            memory_gib=peak_memory_gib(self.dims.device),
            skipped_steps=int(vetoes.total),
        )
        record.update({f"skipped_steps.{k}": int(v) for k, v in vetoes.by_plugin.items()})
        if isinstance(train_data, MixtureDataset):
            record.update(train_data.shares())
        return record
