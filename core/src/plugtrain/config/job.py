"""``JobConfig``, the whole config (its fields are the core's sections), and what a resume keeps.

The two small sections that configure the job itself, [job] and [plugins], live here too; every
other core section has a module of its own in this package.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugtrain.config.checkpoint import CheckpointConfig
from plugtrain.config.data import DataConfig, ValidationConfig
from plugtrain.config.metrics import MetricsConfig
from plugtrain.config.model import ModelConfig
from plugtrain.config.parallelism import ParallelismConfig
from plugtrain.config.training import LRSchedulerConfig, OptimizerConfig, TrainingConfig
from plugtrain.errors import ConfigError
from plugtrain.urls import check_url, is_url


@dataclass
class JobInfoConfig:
    """Where the run writes its records, and how it is described."""

    dump_folder: str = "outputs/run"
    """Folder the run writes its metrics, resolved config and checkpoints to; or an fsspec URL
    (``s3://bucket/prefix``, extra ``plugtrain[s3]``) for the checkpoints alone, with
    ``local_folder`` for the rest (docs/checkpoints.md, "Object storage")."""
    local_folder: str = ""
    """Folder for the files the run keeps locally (metrics, run records, logs of skipped data,
    traces, the run's lock); empty: ``dump_folder`` itself. Needed when ``dump_folder`` is a
    URL."""
    description: str = "plugtrain run"
    """Free text, recorded with the run."""

    def __post_init__(self) -> None:
        if is_url(self.dump_folder):
            check_url(self.dump_folder, "job.dump_folder")
            if not self.local_folder:
                raise ConfigError(
                    f"job.dump_folder {self.dump_folder} is a URL, which holds the checkpoints "
                    "only: set job.local_folder to a local folder for the metrics and run records"
                )
        elif is_url(self.local_folder):
            raise ConfigError(
                f"job.local_folder {self.local_folder} must be a local folder, not a URL"
            )

    @property
    def records_folder(self) -> str:
        """The local folder of the run's metrics, records, traces and lock."""
        return self.local_folder or self.dump_folder


@dataclass
class PluginsConfig:
    """Which installed plugins the run loads."""

    enabled: list[str] = field(default_factory=list)
    """Names of the installed plugins to load, e.g. ``["grad_clip"]``; others are never imported."""


@dataclass
class JobConfig:
    """The whole config: the core's sections, plus one section per enabled plugin."""

    # The core's sections, in order: a new one is a module of this package and a field here.
    job: JobInfoConfig = field(default_factory=JobInfoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    plugin_sections: dict[str, Any] = field(default_factory=dict)
    """Each enabled plugin's validated config dataclass, by plugin name."""

    def __post_init__(self) -> None:
        # Unset, these are the initial load's own (a Hugging Face folder's), if it has them.
        initial = self.checkpoint.initial_load_path
        if not self.model.tokenizer_path:
            folder_tokenizer = Path(initial, "tokenizer.json")
            self.model.tokenizer_path = (
                str(folder_tokenizer)
                if initial and folder_tokenizer.is_file()
                else "sample:tokenizer.json"
            )
        if self.model.flavor == "hf" and not self.model.hf_config:
            self.model.hf_config = _hf_folder(initial)
        if self.model.attention != "auto":
            self.resolve_attention(chat=False)
        lr, steps = self.lr_scheduler, self.training.steps
        if lr.decay_type == "wsd" and lr.warmup_steps + lr.decay_steps > steps:
            raise ConfigError(
                f"config keys 'lr_scheduler.warmup_steps' ({lr.warmup_steps}) + "
                f"'lr_scheduler.decay_steps' ({lr.decay_steps}) exceed 'training.steps' "
                f"({steps}): lower them or raise training.steps"
            )

    def resolve_attention(self, *, chat: bool) -> None:
        """Resolve ``model.attention = "auto"`` (``document`` for chat training data, else
        ``causal``), then ``data.reset_positions = "auto"`` from it; explicit values stay. The
        trainer calls it once it knows whether its data is chat, before anything reads them."""
        if self.model.attention == "auto":
            self.model.attention = "document" if chat else "causal"
        if self.data.reset_positions == "auto":
            self.data.reset_positions = self.model.attention == "document"

    def plugin(self, name: str) -> Any:
        """The config section of plugin ``name``."""
        if name not in self.plugin_sections:
            raise KeyError(f"plugin '{name}' has no config section in this run")
        return self.plugin_sections[name]

    def plugins_fixed_on_resume(self) -> dict[str, tuple[str, ...]]:
        """The settings each enabled plugin's resumed run keeps, by section: the keys its config
        dataclass names in ``FIXED_ON_RESUME`` (a ``ClassVar``; none if it names none)."""
        return {
            name: tuple(getattr(section, "FIXED_ON_RESUME", ()))
            for name, section in self.plugin_sections.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain data, plugin sections included (for the run's records)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in CORE_SECTIONS}
        out.update({k: dataclasses.asdict(v) for k, v in self.plugin_sections.items()})
        return out


def _hf_folder(initial: str) -> str:
    """``checkpoint.initial_load_path`` as flavor ``hf``'s config folder (``model.hf_config``
    unset); a one-line :class:`ConfigError` naming what is wrong with it."""
    key, fix = "checkpoint.initial_load_path", "give a Hugging Face folder (config.json, "
    fix += "model.safetensors), or set model.hf_config to a config.json"
    if not initial:
        raise ConfigError(
            "config key 'model.hf_config' is empty: with flavor 'hf' set it to a config.json, "
            f"or set {key} to a Hugging Face folder"
        )
    if is_url(initial):
        raise ConfigError(
            f"{key} '{initial}' is a URL, but flavor 'hf' reads config.json from a local "
            "folder: set model.hf_config to a local config.json"
        )
    folder = Path(initial)
    if not folder.exists():
        raise ConfigError(f"{key} '{initial}' does not exist: {fix}")
    if not folder.is_dir():
        raise ConfigError(f"{key} '{initial}' is a file, not a folder: {fix}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key} '{initial}' has no config.json: {fix}")
    return initial


def _core_sections() -> typing.Mapping[str, type]:
    hints = typing.get_type_hints(JobConfig)
    fields = dataclasses.fields(JobConfig)
    return types.MappingProxyType(
        {f.name: hints[f.name] for f in fields if f.name != "plugin_sections"}
    )


CORE_SECTIONS = _core_sections()
"""The core's config dataclasses by section name: every field of :class:`JobConfig` but
``plugin_sections``, in declaration order (the order of ``--help`` and the run's records)."""


FIXED_ON_RESUME: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "training": (
        "batch_size",
        "seq_len",
        "grad_accum_steps",
        "seed",
        "mixed_precision_param",
        "mixed_precision_reduce",
    ),
    "optimizer": None,
    "lr_scheduler": None,
    "data": ("text_field", "shuffle", "reset_positions", "format", "chat_loss", "chat_overlong"),
}
"""The settings a resumed run keeps, by section (None: every key): they define the run's
trajectory, so the run a resume continues must be the one they started. Every other setting
may change on resume (docs/checkpoints.md). A plugin's config dataclass names its own in a
``FIXED_ON_RESUME`` class attribute (:meth:`JobConfig.plugins_fixed_on_resume`)."""


def fixed_on_resume(
    values: typing.Mapping[str, typing.Mapping[str, Any]],
    fixed: typing.Mapping[str, tuple[str, ...] | None] = FIXED_ON_RESUME,
) -> dict[str, Any]:
    """The settings of ``values`` (:meth:`JobConfig.to_dict`, or its JSON) that a resumed run
    keeps, by dotted key (``optimizer.lr``), in section order: the core's, or those of
    ``fixed`` (keys by section, None for every key)."""
    return {
        f"{section}.{key}": value
        for section, keys in fixed.items()
        for key, value in values.get(section, {}).items()
        if keys is None or key in keys
    }
