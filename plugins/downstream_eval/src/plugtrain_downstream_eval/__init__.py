"""Downstream multiple-choice tasks scored at each validation, as a plugtrain plugin.

At each validation pass (``validation_metrics``: the model's own weights, then each weight set
a plugin offers, such as ema's) every rank scores its share of each task's items with
:func:`plugtrain.plugin.score`, the scorer ``plugtrain eval`` uses, on the model as it trains
(FSDP2-sharded, tensor-parallel or neither; under tensor parallelism the items are split over
the data-parallel ranks, and the ranks of a ``tp`` group score the same ones). Logged as
``downstream_eval/<task>/acc`` and ``.../acc_norm`` (``ema/downstream_eval/<task>/acc`` for
ema's weights); the console shows each task's ``acc``.
The task files are read and tokenized once, in ``setup``: a bad file stops the run there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed import ProcessGroup

from plugtrain.plugin import (
    ConfigError,
    EncodedTasks,
    SetupContext,
    ValidationContext,
    check_field,
    data_parallel_group,
    encode_tasks,
    hookimpl,
    read_task,
    refuse_split_model,
    score,
)

__all__ = ["DownstreamEval", "DownstreamEvalConfig"]


@dataclass
class DownstreamEvalConfig:
    """The ``[downstream_eval]`` config section."""

    tasks: list[str] = field(default_factory=lambda: ["sample:cloze.jsonl"])
    """Task files (JSONL; ``sample:cloze.jsonl`` is the shipped Shakespeare cloze), each logged
    under its file name's stem."""
    max_items: int = 100
    """Items scored per task at each validation, evenly spaced through the file (the same ones
    every time); 0: all."""
    batch_size: int = 32
    """Choices (sequences) per forward."""

    def __post_init__(self) -> None:
        check_field(bool(self.tasks), "tasks", "must name at least one task file")
        check_field(self.max_items >= 0, "max_items", f"must be >= 0, got {self.max_items}")
        check_field(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")


class DownstreamEval:
    """Logs ``downstream_eval/<task>/acc`` and ``/acc_norm`` at each validation pass."""

    def __init__(self) -> None:
        self.config = DownstreamEvalConfig()
        self.model = None
        self.rank, self.world_size = 0, 1
        self.group: ProcessGroup | None = None
        self.tasks: EncodedTasks | None = None

    @hookimpl
    def config_section(self) -> type:
        return DownstreamEvalConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = cfg = ctx.plugin_config(self)
        refuse_split_model(ctx.parallel_dims, ctx.name_of(self))
        if not ctx.config.validation.interval:
            ctx.deactivate(self, "validation.interval is 0: no validation to score tasks at")
            return
        tasks = [read_task(path) for path in cfg.tasks]
        names = [task.name for task in tasks]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(
                    f"config key '{ctx.name_of(self)}.tasks' names two files called '{name}': "
                    "each task is logged under its file name, so rename one"
                )
        assert ctx.tokenizer is not None, "a run's setup gives its tokenizer"
        # The items are split over the ranks that train on different data: a tp group's
        # ranks join the same forwards.
        dims = ctx.parallel_dims
        self.group = data_parallel_group(dims)
        self.model, self.rank, self.world_size = ctx.model, dims.dp_rank, dims.dp_size
        max_seq_len = ctx.model.args.max_seq_len
        self.tasks = encode_tasks(tasks, ctx.tokenizer, max_seq_len, cfg.max_items)
        ctx.show_on_console(self, *(f"{name}/acc" for name in names))

    @hookimpl
    def validation_metrics(self, ctx: ValidationContext) -> dict[str, float]:
        assert self.tasks is not None and self.model is not None, "setup encodes the tasks"
        scores = score(
            self.model,
            self.tasks,
            batch_size=self.config.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            group=self.group,
        )
        metrics = {}
        for name, result in scores.items():
            metrics[f"{name}/acc"] = result.acc
            metrics[f"{name}/acc_norm"] = result.acc_norm
        return metrics
