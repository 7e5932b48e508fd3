"""The run's config: nested dataclasses, filled from a TOML file and command-line overrides.

Every field has a default, so ``python train.py`` runs with none given. A TOML file
(``--config configs/debug.toml``) sets any field by section, and ``--section.key value``
overrides any field on the command line, plugin sections included. Unknown sections and keys,
wrong types and out-of-range values raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from plugtrain.config.reading import (
    LIST_SYNTAX,
    build_section,
    coerce,
    field_docs,
    help_type,
    section_doc,
)
from plugtrain.errors import ConfigError, FieldError, check_field, did_you_mean, require_extra
from plugtrain.model import FLAVORS, ModelArgs, RopeScaling, run_model_args

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class JobInfoConfig:
    """Where the run writes its records, and how it is described."""

    dump_folder: str = "outputs/run"
    """Folder the run writes its metrics, resolved config and checkpoints to."""
    description: str = "plugtrain run"
    """Free text, recorded with the run."""


@dataclass
class ModelConfig:
    """The model's shape and the tokenizer that sets its vocabulary."""

    flavor: str = field(default="debug", metadata={"choices": (*FLAVORS, "hf")})
    """Model size: ``tiny``, ``debug``, ``1B``, ``8B``... (``model.args.FLAVORS``), or ``hf``:
    the shape a Hugging Face ``config.json`` gives (``model.hf_config``)."""
    hf_config: str = ""
    """With flavor ``hf``: a ``LlamaForCausalLM`` config.json, or the folder holding it. Its
    sizes, ``intermediate_size``, RoPE (theta, ``llama3`` scaling), tied embeddings, positions
    and vocabulary make the model; the tokenizer's vocabulary must fit in its ``vocab_size``.
    A field the model cannot express (biases, sliding window, another model or RoPE type) is
    refused, named."""
    tokenizer_path: str = ""
    """A ``tokenizers`` ``tokenizer.json``; its vocabulary size sets the model's (with flavor
    ``hf``, config.json's does). Unset (""): the ``tokenizer.json`` of the Hugging Face folder
    ``checkpoint.initial_load_path`` names, if it has one, else ``sample:tokenizer.json``. Here
    and in the data paths, ``sample:NAME`` names a file of the Shakespeare sample shipped with
    plugtrain; any other path is relative to the current folder."""
    tie_embeddings: bool = False
    """The output projection is the token embedding's matrix (Llama 3.2 1B/3B, SmolLM): one
    ``vocab x dim`` tensor fewer. Not with flavor ``hf`` (config.json says)."""
    ffn_dim: int | None = None
    """The SwiGLU hidden size exactly (Hugging Face's ``intermediate_size``); unset, the flavor
    derives it from its ``multiple_of`` and ``ffn_dim_multiplier``. Not with flavor ``hf``."""
    rope_scaling: Literal["none", "llama3"] = "none"
    """``llama3``: Llama 3.1's RoPE frequency scaling, set by the four ``rope_*`` keys below
    (their defaults are Llama 3.1's). Not with flavor ``hf``."""
    rope_scaling_factor: float = 8.0
    """llama3 scaling: the low frequencies are divided by this."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above ``rope_original_max_seq_len / this`` are scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below ``rope_original_max_seq_len / this`` are kept."""
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: the context length of the unscaled model."""

    def __post_init__(self) -> None:
        choices = (*FLAVORS, "hf")
        if self.flavor not in choices:
            raise ConfigError(
                f"config key 'model.flavor' is '{self.flavor}'{did_you_mean(self.flavor, choices)};"
                f" choose one of {', '.join(choices)}"
            )
        if self.flavor == "hf":
            for key, default in _SHAPE_OPTIONS.items():
                check_field(
                    getattr(self, key) == default,
                    key,
                    f"is {getattr(self, key)!r}, but with flavor 'hf' config.json sets the "
                    f"shape: leave it at {default!r}",
                )
        else:
            check_field(
                not self.hf_config,
                "hf_config",
                f"is set, but flavor is '{self.flavor}': set model.flavor = \"hf\" to use it",
            )
        ffn_dim = self.ffn_dim
        check_field(ffn_dim is None or ffn_dim >= 1, "ffn_dim", f"must be >= 1, got {ffn_dim}")
        try:
            self.rope_scaling_args()
        except ValueError as e:
            raise FieldError("rope_scaling", f"is unusable: {e}") from None

    def rope_scaling_args(self) -> RopeScaling | None:
        """The RoPE scaling the ``rope_*`` keys ask for, or None."""
        if self.rope_scaling == "none":
            return None
        return RopeScaling(
            factor=self.rope_scaling_factor,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor,
            original_max_seq_len=self.rope_original_max_seq_len,
        )

    def model_args(self, vocab_size: int | None, seq_len: int) -> ModelArgs:
        """The shape a run of this config trains on sequences of ``seq_len`` tokens, with a
        tokenizer of ``vocab_size`` tokens (None: the flavor's or config.json's vocabulary).

        With flavor ``hf`` the embedding has config.json's rows; a tokenizer with more tokens is
        refused in one line. The RoPE table always reaches ``seq_len``.
        """
        if self.flavor == "hf":
            # Here, not at the top: the rest of the config, and --help, need no torch.
            from plugtrain.model import model_args_from_hf, read_hf_config

            args = model_args_from_hf(read_hf_config(self.hf_config))
            if vocab_size is not None and vocab_size > args.vocab_size:
                raise ConfigError(
                    f"the tokenizer has {vocab_size} tokens, more than the {args.vocab_size} "
                    f"rows of the embedding model.hf_config '{self.hf_config}' gives: use the "
                    "tokenizer of that model (model.tokenizer_path)"
                )
            return dataclasses.replace(args, max_seq_len=max(args.max_seq_len, seq_len))
        if vocab_size is None:
            vocab_size = FLAVORS[self.flavor].vocab_size
        args = run_model_args(self.flavor, vocab_size, seq_len)
        return dataclasses.replace(
            args,
            tie_embeddings=self.tie_embeddings,
            ffn_dim=self.ffn_dim if self.ffn_dim is not None else args.ffn_dim,
            rope_scaling=self.rope_scaling_args(),
        )


_SHAPE_OPTIONS = {"tie_embeddings": False, "ffn_dim": None, "rope_scaling": "none"}
"""The [model] keys that change a flavor's shape, and their defaults (unset with flavor hf)."""


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
class ParallelismConfig:
    """How the ranks shard the model: FSDP over all of them, or hybrid sharding (HSDP)."""

    # Every rank trains on its own slice of each batch either way: the degrees only decide
    # where each parameter's shards live. Their product is the world size.
    dp_replicate: int = 1
    """Copies of the sharded model (HSDP's replicas, one per node typically): gradients are
    reduce-scattered within a copy, then all-reduced across copies once per optimizer step.
    1: plain FSDP over all ranks."""
    dp_shard: int = -1
    """Ranks each copy of the model is sharded over (the GPUs of one node typically); -1: the
    world size divided by ``dp_replicate``."""

    def __post_init__(self) -> None:
        check_field(
            self.dp_replicate >= 1, "dp_replicate", f"must be >= 1, got {self.dp_replicate}"
        )
        check_field(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "dp_shard",
            f"must be >= 1, or -1 for the rest of the ranks, got {self.dp_shard}",
        )


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
    """Decoupled weight decay, applied to every parameter."""

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


@dataclass
class DataConfig:
    """The training and validation documents."""

    train_path: str = "sample:train.jsonl"
    """JSONL file of training documents, one JSON object per line."""
    validation_path: str = "sample:validation.jsonl"
    """JSONL file of held-out documents for the validation loss."""
    text_field: str = "text"
    """The key of each JSON object that holds the document's text."""
    shuffle: bool = True
    """Shuffle training samples (a new seeded permutation each epoch)."""
    sources: list[dict] = field(default_factory=list)
    """A mixture that replaces ``train_path``: ``[{path=..., weight=...}, ...]``, each path a
    prepared folder or a data file, sampled in proportion to its weight (optional ``name``,
    default the path's last part, names its logged share ``data_share.<name>``)."""

    def __post_init__(self) -> None:
        for i, source in enumerate(self.sources):
            where = f"item {i} ({source!r})"
            check_field(
                isinstance(source.get("path"), str)
                and set(source) <= {"path", "weight", "name"}
                and isinstance(source.get("weight", 1.0), (int, float))
                and not isinstance(source.get("weight"), bool)
                and isinstance(source.get("name", ""), str),
                "sources",
                f'{where} must be {{path="...", weight=<number>, name="..." (optional)}}',
            )
            weight = source.get("weight", 1.0)
            check_field(weight > 0, "sources", f"{where} has weight {weight}: must be > 0")
        names = self.source_names()
        check_field(
            len(set(names)) == len(names),
            "sources",
            f"names {names} repeat: give each source a distinct name=",
        )

    def source_names(self) -> list[str]:
        """The name of each of ``sources``: its ``name``, or its path's last part."""
        return [s.get("name") or Path(s["path"]).name for s in self.sources]


@dataclass
class ValidationConfig:
    """How often and on how many batches the validation loss is measured."""

    interval: int = 50
    """Evaluate the validation loss every this many steps and at the end; 0 disables it."""
    steps: int = 4
    """Validation batches (of ``training.batch_size`` sequences) per evaluation."""

    def __post_init__(self) -> None:
        check_field(self.interval >= 0, "interval", f"must be >= 0, got {self.interval}")
        check_field(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")


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
    """Peak TFLOP/s per device for MFU; 0 detects it (H100, H200, A100; no MFU on CPU)."""
    log_all_ranks: bool = False
    """Log INFO from every rank, prefixed with its rank (by default only rank 0 does)."""

    def __post_init__(self) -> None:
        check_field(self.log_freq >= 1, "log_freq", f"must be >= 1, got {self.log_freq}")
        check_field(self.peak_tflops >= 0, "peak_tflops", f"must be >= 0, got {self.peak_tflops}")
        if self.enable_tensorboard:
            require_extra("tensorboard", "tensorboard", "metrics.enable_tensorboard")
        if self.enable_wandb:
            require_extra("wandb", "wandb", "metrics.enable_wandb")


@dataclass
class CheckpointConfig:
    """Saving checkpoints and resuming from them."""

    enable: bool = False
    """Save checkpoints to ``<job.dump_folder>/checkpoints/step-<N>/`` and resume from them: a
    run started again with the same dump folder continues where the last complete one left off."""
    interval: int = 500
    """Save every this many steps; a run also saves at its last step and when it stops on
    SIGTERM or SIGINT."""
    keep_latest_k: int = 3
    """Keep the newest this many complete checkpoints, deleting older ones after each save; 0
    keeps every one."""
    load_step: int = -1
    """Checkpoint to resume from: -1 the latest complete one (none: train from scratch), N the
    one of step N (an error if it does not exist), 0 none (train from scratch). N or 0 in a
    folder holding later complete checkpoints is an error, unless ``discard_later`` is set."""
    discard_later: bool = False
    """Delete, at start-up, the complete checkpoints after the one ``load_step`` picks (with
    ``load_step`` 0: all of them), written by an earlier run; without it such a start is
    refused, since this run would overwrite them."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """``async``: copy the state to CPU memory, then write it in a background thread while
    training goes on (``dcp.async_save``); ``disabled``: training waits for each save."""
    initial_load_path: str = ""
    """Start a new run from these weights instead of random ones: a Hugging Face Llama folder
    (``config.json`` and ``model.safetensors``, sharded or not; its ``tokenizer.json`` is used
    unless ``model.tokenizer_path`` is set) or a plugtrain ``step-N`` checkpoint folder. Ignored
    when the dump folder holds checkpoints: the run then resumes from them. ``model.flavor``
    must have the loaded model's shape."""
    initial_load_model_only: bool = True
    """With ``initial_load_path`` a plugtrain checkpoint: false takes AdamW's state (moments and
    its step count) too, e.g. to branch a decay run from a stable-phase checkpoint. The step,
    LR schedule and data position always start afresh with this run's settings."""

    def __post_init__(self) -> None:
        check_field(self.interval >= 1, "interval", f"must be >= 1, got {self.interval}")
        check_field(
            self.keep_latest_k >= 0,
            "keep_latest_k",
            f"must be >= 0 (0 keeps all), got {self.keep_latest_k}",
        )
        check_field(
            self.load_step >= -1,
            "load_step",
            f"must be -1 (latest), 0 (none) or a step, got {self.load_step}",
        )
        check_field(
            self.enable or self.load_step == -1,
            "load_step",
            "needs checkpoint.enable = true: add --checkpoint.enable true",
        )
        check_field(
            self.enable or not self.discard_later,
            "discard_later",
            "needs checkpoint.enable = true: add --checkpoint.enable true",
        )
        check_field(
            self.initial_load_model_only or bool(self.initial_load_path),
            "initial_load_model_only",
            "false needs checkpoint.initial_load_path: set it to a step-N folder",
        )


@dataclass
class PluginsConfig:
    """Which installed plugins the run loads."""

    enabled: list[str] = field(default_factory=list)
    """Names of the installed plugins to load, e.g. ``["grad_clip"]``; others are never imported."""


@dataclass
class JobConfig:
    """The whole config: the core's sections, plus one section per enabled plugin."""

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
            if not (initial and Path(initial, "config.json").is_file()):
                raise ConfigError(
                    "config key 'model.hf_config' is empty: with flavor 'hf' name a config.json"
                    " (or set checkpoint.initial_load_path to a Hugging Face folder)"
                )
            self.model.hf_config = initial
        lr, steps = self.lr_scheduler, self.training.steps
        if lr.decay_type == "wsd" and lr.warmup_steps + lr.decay_steps > steps:
            raise ConfigError(
                f"config keys 'lr_scheduler.warmup_steps' ({lr.warmup_steps}) + "
                f"'lr_scheduler.decay_steps' ({lr.decay_steps}) exceed 'training.steps' "
                f"({steps}): lower them or raise training.steps"
            )

    def plugin(self, name: str) -> Any:
        """The config section of plugin ``name``."""
        if name not in self.plugin_sections:
            raise KeyError(f"plugin '{name}' has no config section in this run")
        return self.plugin_sections[name]

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain data, plugin sections included (for the run's records)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in _core_sections()}
        out.update({k: dataclasses.asdict(v) for k, v in self.plugin_sections.items()})
        return out


def _core_sections() -> dict[str, type]:
    """The core's config dataclasses by section name: every field of :class:`JobConfig` but
    ``plugin_sections``, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    fields = dataclasses.fields(JobConfig)
    return {f.name: hints[f.name] for f in fields if f.name != "plugin_sections"}


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
    "data": ("text_field", "shuffle"),
}
"""The settings a resumed run keeps, by section (None: every key): they define the run's
trajectory, so the run a resume continues must be the one they started. Every other setting
may change on resume (README.md, "Checkpoints")."""


def fixed_on_resume(values: typing.Mapping[str, typing.Mapping[str, Any]]) -> dict[str, Any]:
    """The settings of ``values`` (:meth:`JobConfig.to_dict`, or its JSON) that a resumed run
    keeps, by dotted key (``optimizer.lr``), in section order."""
    return {
        f"{section}.{key}": value
        for section, keys in FIXED_ON_RESUME.items()
        for key, value in values.get(section, {}).items()
        if keys is None or key in keys
    }


# --------------------------------------------------------------------------- the command line


@dataclass
class CommandLine:
    """``train.py``'s arguments: a config file, ``--section.key value`` overrides, --help."""

    config_file: str | None = None
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    help: bool = False


def parse_command_line(argv: list[str]) -> CommandLine:
    """Split ``argv`` into the config file and the ``--section.key value`` overrides."""
    cli = CommandLine()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            cli.help = True
            continue
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}: use --config FILE and --section.key VALUE"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ConfigError(f"argument '--{name}' needs a value")
            if args[0].startswith("--"):
                raise ConfigError(
                    f"argument '--{name}' needs a value, but '{args[0]}' follows it "
                    f"(a value that starts with -- goes as --{name}=VALUE)"
                )
            value = args.pop(0)
        if name == "config":
            cli.config_file = value
            continue
        section, dot, key = name.partition(".")
        if not dot or not key:
            raise ConfigError(
                f"argument '--{name}' must be --section.key (e.g. --training.steps 50)"
            )
        cli.overrides.setdefault(section, {})[key] = value
    return cli


SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The configs shipped with plugtrain (the repository's configs/ folder)."""


def config_file(path: str) -> Path:
    """``--config``'s file: ``path``, or for a bare name such as ``debug`` that is no file, the
    shipped config of that name (``configs/debug.toml``)."""
    p = Path(path)
    if p.is_file() or p.name != path or p.suffix:
        return p
    return SHIPPED_CONFIGS / f"{path}.toml"


def read_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file, with one-line errors for a missing or malformed file."""
    p = config_file(path)
    if not p.is_file():
        shipped = ", ".join(sorted(c.stem for c in SHIPPED_CONFIGS.glob("*.toml")))
        raise ConfigError(
            f"config file '{path}' not found: pass an existing file to --config, or the name "
            f"of a shipped config ({shipped})"
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from e
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"config file '{path}': top-level key '{section}' must be a [section] table"
            )
    return data


def merged_values(cli: CommandLine) -> dict[str, dict[str, Any]]:
    """The TOML file's sections with the command-line overrides applied on top."""
    values = read_toml(cli.config_file) if cli.config_file else {}
    for section, kv in cli.overrides.items():
        values.setdefault(section, {}).update(kv)
    return values


def enabled_plugins(values: dict[str, dict[str, Any]]) -> list[str]:
    """``plugins.enabled`` from the merged values, before the full config is built."""
    return coerce(values.get("plugins", {}).get("enabled", []), list[str], "plugins.enabled")


def build_config(
    values: dict[str, dict[str, Any]],
    plugin_sections: dict[str, type],
    installed: typing.Iterable[str] = (),
) -> JobConfig:
    """Build and validate the :class:`JobConfig` from merged values.

    ``plugin_sections`` maps each enabled plugin with a config section to its dataclass;
    ``installed`` names every installed plugin, to explain a section of a disabled one.
    """
    core = _core_sections()
    known = [*core, *plugin_sections]
    for section in values:
        if section in known:
            continue
        if section in installed:
            raise ConfigError(
                f"config section [{section}] configures plugin '{section}', which is not "
                f"enabled: add '{section}' to plugins.enabled or remove the section"
            )
        raise ConfigError(
            f"unknown config section [{section}]{did_you_mean(section, known)}; "
            f"sections: {', '.join(known)}"
        )
    return JobConfig(
        **{name: build_section(cls, name, values.get(name, {})) for name, cls in core.items()},
        plugin_sections={
            name: build_section(cls, name, values.get(name, {}))
            for name, cls in plugin_sections.items()
        },
    )


def _help_section(lines: list[str], section: str, cls: type) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    if doc := section_doc(cls):
        lines.append(textwrap.fill(doc, 100, initial_indent="  ", subsequent_indent="  "))
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        lines.append(f"  --{section}.{f.name} ({help_type(f, hints[f.name])}; default {default!r})")
        if f.name in docs:
            lines.append(
                textwrap.fill(docs[f.name], 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
            )


def format_help(
    plugin_sections: dict[str, type],
    disabled_plugins: typing.Sequence[str] = (),
    prog: str = "train.py",
) -> str:
    """Every section and field with its type, default and docstring, for the command ``prog``.

    ``plugin_sections`` are the enabled plugins' sections; ``disabled_plugins`` names the
    installed plugins that are not enabled, whose sections the help only says how to see.
    """
    lines = [
        f"usage: {prog} [--config FILE] [--section.key VALUE ...]",
        "",
        "Every field can be set in the TOML file's [section] or overridden on the command line.",
        f"A list is written {LIST_SYNTAX}: --plugins.enabled grad_clip,ema.",
        "--config takes a TOML file, or the name of a config shipped with plugtrain: "
        + ", ".join(sorted(c.stem for c in SHIPPED_CONFIGS.glob("*.toml")))
        + ".",
    ]
    sections = {**_core_sections(), **plugin_sections}
    for section, cls in sections.items():
        lines.append(f"\n[{section}]")
        _help_section(lines, section, cls)
    if disabled_plugins:
        names = ", ".join(disabled_plugins)
        lines.append("\n" + textwrap.fill(f"Installed plugins that are not enabled: {names}.", 100))
        lines.append(f"Their sections show once enabled: {prog} --plugins.enabled NAME,... --help")
    return "\n".join(lines)
