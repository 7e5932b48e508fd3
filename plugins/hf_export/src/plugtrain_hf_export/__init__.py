"""Writes each checkpoint (or the last) as a Hugging Face Llama folder, ``step-<N>/hf/``.

The folder is what ``plugtrain export-hf step-<N>`` writes, byte for byte: ``model.safetensors``
(or shards), ``config.json``, ``generation_config.json`` and the tokenizer (with the chat
template a chat run trained with), loadable by
``transformers.LlamaForCausalLM`` and ``AutoTokenizer`` with no other file. Rank 0 reads the
committed checkpoint one tensor at a time, so the export holds one tensor in memory, needs no
collective, and exports what was saved at step N even when an asynchronous save lets training
move on before ``checkpoint_saved`` fires. It works under pipeline parallelism as well: the
checkpoint holds every stage's weights under the whole model's names. A ``job.dump_folder`` on
an object store (a URL) is refused: ``plugtrain export-hf`` reads its checkpoints there into a
local folder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from plugtrain.plugin import ConfigError, HfExporter, SetupContext, hookimpl

__all__ = ["HfExport", "HfExportConfig"]

logger = logging.getLogger("plugtrain")


@dataclass
class HfExportConfig:
    """The ``[hf_export]`` config section."""

    every: Literal["checkpoint", "last"] = "checkpoint"
    """Export every checkpoint, or only the one at the run's last step (``training.steps``)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of every floating tensor in the export (``config.json`` says the same); ``auto``:
    the checkpoint's, float32."""
    weights: Literal["model", "ema"] = "model"
    """The trained weights, or the ``ema`` plugin's average (the run must enable it)."""
    max_shard_size: int = 5 * 10**9
    """Bytes of tensors per safetensors file; above it the export is split into shards."""


class HfExport:
    """Exports ``step-<N>/`` to ``step-<N>/hf/`` on rank 0 once the checkpoint is complete."""

    export: HfExporter
    """The run's exporter (``SetupContext.export_hf``), set in ``setup``, before any save."""

    def __init__(self) -> None:
        self.config = HfExportConfig()
        self.rank = 0
        self.last_step = 0

    @hookimpl
    def config_section(self) -> type:
        return HfExportConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)
        self.rank = ctx.parallel_dims.rank
        self.export = ctx.export_hf
        self.last_step = ctx.config.training.steps
        url = ctx.config.job.dump_folder
        if "://" in url:  # its folders go beside a checkpoint's files, which a URL has not
            raise ConfigError(
                f"plugin '{ctx.name_of(self)}' writes step-<N>/hf/ beside each checkpoint, but "
                f"job.dump_folder {url} is a URL: disable the plugin and run "
                f"'plugtrain export-hf {url} -o FOLDER' once the run has saved"
            )
        if self.config.weights == "ema" and "ema" not in ctx.config.plugins.enabled:
            raise ConfigError(
                f"config key '{ctx.name_of(self)}.weights' is 'ema', but the ema plugin is not "
                "enabled: add it to plugins.enabled, or export weights = 'model'"
            )

    @hookimpl
    def checkpoint_saved(self, folder: Path, step: int) -> None:
        if self.rank != 0 or (self.config.every == "last" and step != self.last_step):
            return
        out = folder / "hf"
        self.export(
            folder,
            out,
            dtype=None if self.config.dtype == "auto" else getattr(torch, self.config.dtype),
            weights=self.config.weights,
            max_shard_size=self.config.max_shard_size,
            overwrite=True,  # a checkpoint is never rewritten: an hf/ there is this one's
        )
        logger.info("hf_export: wrote %s", out)
