"""The run's config: nested dataclasses, filled from a TOML file and command-line overrides.

Every field has a default, so ``python train.py`` runs with none given. A TOML file
(``--config configs/debug.toml``) sets any field by section, and ``--section.key value``
overrides any field on the command line, plugin sections included. Unknown sections and keys,
wrong types and out-of-range values raise :class:`ConfigError` naming the key.

Each group of core sections is a module of this package (``model``, ``training``, ...), and
``job`` lists them as the fields of ``JobConfig``: a new section is a new module and one field
there. ``reading`` reads any section, ``loading`` is the one loader. Other packages import the
names below from ``plugtrain.config``; none of it imports torch, so ``--help`` stays light.
"""

from __future__ import annotations

from plugtrain.config.checkpoint import CheckpointConfig
from plugtrain.config.data import (
    CHAT_LOSSES,
    CHAT_OVERLONG,
    DATA_FORMATS,
    DataConfig,
    ValidationConfig,
)
from plugtrain.config.job import (
    CORE_SECTIONS,
    FIXED_ON_RESUME,
    JobConfig,
    JobInfoConfig,
    PluginsConfig,
    fixed_on_resume,
)
from plugtrain.config.loading import (
    SHIPPED_CONFIGS,
    CommandLine,
    build_config,
    enabled_plugins,
    format_help,
    merged_values,
    parse_command_line,
)
from plugtrain.config.metrics import MetricsConfig
from plugtrain.config.model import ModelConfig
from plugtrain.config.parallelism import PIPELINE_SCHEDULES, V_SCHEDULES, ParallelismConfig
from plugtrain.config.reading import build_section, coerce, field_docs, section_doc
from plugtrain.config.training import LRSchedulerConfig, OptimizerConfig, TrainingConfig

__all__ = [
    "CHAT_LOSSES",
    "CHAT_OVERLONG",
    "CORE_SECTIONS",
    "DATA_FORMATS",
    "FIXED_ON_RESUME",
    "PIPELINE_SCHEDULES",
    "SHIPPED_CONFIGS",
    "V_SCHEDULES",
    "CheckpointConfig",
    "CommandLine",
    "DataConfig",
    "JobConfig",
    "JobInfoConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PluginsConfig",
    "TrainingConfig",
    "ValidationConfig",
    "build_config",
    "build_section",
    "coerce",
    "enabled_plugins",
    "field_docs",
    "fixed_on_resume",
    "format_help",
    "merged_values",
    "parse_command_line",
    "section_doc",
]
