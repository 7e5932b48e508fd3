"""Tiny real runs: their arguments, the trainer, what they did (losses, hooks, checksums).

The shipped sample (:data:`SAMPLE`) is the data; :func:`tiny_run` trains on 1 or more
processes and returns a :class:`RunResult`; :func:`make_trainer` gives the :class:`Trainer`
itself, whose ``loss.fn`` is its loss, for tests that write a reference loop out. This
is the one module of the kit that imports the trainer: like ``train.py``, it is an entry point
that builds runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plugtrain import sample
from plugtrain.plugin import (
    ConvertContext,
    LossContext,
    ModelContext,
    OptimizerContext,
    SetupContext,
    StepContext,
    ValidationContext,
    hookimpl,
    local_tensor,
)
from plugtrain.testing.processes import run_distributed
from plugtrain.testing.session import session_cache
from plugtrain.training import Trainer, configure

__all__ = [
    "SAMPLE",
    "HookLog",
    "RunResult",
    "Trainer",
    "make_trainer",
    "max_difference",
    "metrics_by_step",
    "parameter_checksums",
    "read_metrics",
    "tiny_args",
    "tiny_run",
]

Plugins = Sequence[tuple[str, object | None]]
"""Plugins registered in this order: ``(name, plugin)``, or ``(name, None)`` to move the
enabled plugin ``name`` to that position."""


SAMPLE = sample.FOLDER
"""The shipped Shakespeare sample's folder (``train.jsonl``, ``validation.jsonl``,
``tokenizer.json``), inside the installed package."""

CHAT = (
    "--data.train_path", str(SAMPLE / "chat_validation.jsonl"),
    "--data.validation_path", str(SAMPLE / "chat_validation.jsonl"),
)  # fmt: skip
"""Arguments that train and validate on the sample's chat data: rows of several short
conversations, document masking and per-document positions, the assistant's tokens only."""


def tiny_args(dump_folder: str | Path, *extra: str, steps: int = 3) -> list[str]:
    """Arguments for a run of the tiny model that takes about a second, then ``extra``.

    It trains on the (small) validation split to keep tokenisation fast, with validation off,
    logs every step and saves no checkpoint unless ``extra`` asks (``--checkpoint.enable true``,
    or ``--checkpoint.save_final true``: the last step's alone, a run's default). It times no
    matmul limit unless ``extra`` asks (``--metrics.matmul_limit true``): a shape not cached
    yet would be timed, and logged, before setup, so what a run says would depend on the runs
    before it.
    """
    return [
        "--job.dump_folder", str(dump_folder),
        "--model.flavor", "tiny",
        "--model.tokenizer_path", str(SAMPLE / "tokenizer.json"),
        "--data.train_path", str(SAMPLE / "validation.jsonl"),
        "--training.steps", str(steps),
        "--training.batch_size", "4",
        "--training.seq_len", "32",
        "--lr_scheduler.warmup_steps", "1",
        "--validation.interval", "0",
        "--metrics.log_freq", "1",
        "--checkpoint.save_final", "false",
        "--metrics.matmul_limit", "false",
        *extra,
    ]  # fmt: skip


def make_trainer(
    dump_folder: str | Path, *args: str, steps: int = 3, plugins: Plugins = ()
) -> Trainer:
    """The :class:`Trainer` of a tiny run configured by ``args``.

    The plugins ``args`` enable (``--plugins.enabled``) are loaded first; then ``plugins`` are
    registered in exactly their order, after the enabled plugins they do not name. A pair
    ``(name, None)`` moves the enabled plugin ``name`` to its position, so a test controls the
    whole registration order: ``[("inject", InjectInf(...)), ("grad_scaler", None)]`` puts the
    injector before the scaler. (pluggy calls later registrations first within a hook.) A
    pair naming an enabled plugin with an object replaces the instance the run loaded. Data
    is prepared into the session's cache (:mod:`plugtrain.testing.session`).
    """
    session_cache()
    configured = configure(tiny_args(dump_folder, *args, steps=steps))
    assert configured is not None, "make_trainer takes no --help"
    config, host = configured
    resolved = [(name, host.get(name) if obj is None else obj) for name, obj in plugins]
    for name, _ in resolved:
        if name in host.names():  # an enabled plugin: moved, or replaced by the object given
            host.unregister(host.get(name))
    for name, obj in resolved:
        host.register(obj, name)
    return Trainer(config, host)


def read_metrics(dump_folder: str | Path) -> list[dict]:
    """The JSONL records a run wrote (rank 0), in order."""
    lines = (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def metrics_by_step(dump_folder: str | Path) -> dict[int, dict]:
    """A run's metrics records by step, those of a step (training, validation) merged."""
    steps: dict[int, dict] = {}
    for record in read_metrics(dump_folder):
        steps.setdefault(record["step"], {}).update(record)
    return steps


def max_difference(
    a: dict[int, dict], b: dict[int, dict], steps: Iterable[int], keys: Iterable[str]
) -> float:
    """The largest absolute difference of metrics ``keys`` between two runs'
    :func:`metrics_by_step` over ``steps`` (a key that either logs at a step is compared)."""
    keys = tuple(keys)
    return max(abs(a[s][k] - b[s][k]) for s in steps for k in keys if k in a[s] or k in b[s])


def relative(ours: float, theirs: float) -> float:
    """``ours``' relative difference from ``theirs`` (0 where equal, as for 0 and 0)."""
    return 0.0 if ours == theirs else abs(ours - theirs) / abs(theirs)


class GradNorms:
    """A plugin that keeps each step's pre-clip grad norm as this rank's ``grad_clip``
    computed it (:attr:`norms`, by step): give it to :func:`make_trainer`'s ``plugins``, then
    :meth:`watch` the trainer. A layout's norms against one process's, on every rank."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}
        self._clip: Any = None

    def watch(self, trainer: Trainer) -> None:
        """Read ``trainer``'s ``grad_clip`` plugin (it must be enabled)."""
        self._clip = trainer.host.get("grad_clip")

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        self.norms[ctx.step] = float(self._clip.total_norm)


def copy_checkpoint(written: Path, resumed: Path, step: int) -> None:
    """Put run ``written``'s step-``step`` checkpoint into dump folder ``resumed``, for a run
    there to resume from it (the later ones left behind): rank 0 copies, every rank waits."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        folder = f"checkpoints/step-{step}"
        shutil.copytree(written / folder, resumed / folder)
    if dist.is_initialized():
        dist.barrier()


def parameter_checksums(model: nn.Module) -> str:
    """A SHA-256 of this rank's parameter shards, bytes and all: equal means bitwise equal.
    A parameter held in another form (QLoRA's NF4) counts by the tensors it holds."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        for tensor in _held_tensors(local_tensor(param.detach())):
            digest.update(tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _held_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """``tensor``, or the plain tensors a tensor subclass (NF4) holds, in its order."""
    if type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        yield tensor
        return
    for name in tensor.__tensor_flatten__()[0]:
        yield from _held_tensors(getattr(tensor, name))


Call = tuple[str, int | None, int | None]
"""One hook call: ``(hook, step, microbatch)``; step and microbatch are None for hooks with no
step."""


def hooks_fired(calls: Iterable[Call]) -> list[str]:
    """The hooks of ``calls`` (a :class:`HookLog`'s or a :class:`RunResult`'s), in the order
    they first fired."""
    return list(dict.fromkeys(hook for hook, _, _ in calls))


class HookLog:
    """Logs every hook call of a run, in order, without changing the run.

    Every hook but ``config_section`` (which fires before any plugin object is registered) is
    implemented. Most are ``wrapper=True`` implementations that record
    ``(hook, step, microbatch)`` and yield, so they see the call before any plain
    implementation. The result hooks (``hookspecs.RESULT_HOOKS``, which refuse wrappers) and
    ``load_state_dict`` are plain ones that add nothing; ``state_dict`` saves a constant, so
    that a resumed run fires ``load_state_dict``. Step and microbatch are None for hooks with no
    step. Each step's skip flag is kept and read only when asked (:meth:`skipped_steps`): a
    run with the log makes no extra host sync.
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._skipped: list[tuple[int, torch.Tensor | None]] = []

    def _log(self, hook: str, ctx: StepContext | None = None) -> None:
        self.calls.append((hook, getattr(ctx, "step", None), getattr(ctx, "microbatch", None)))

    def hooks_fired(self) -> list[str]:
        """The hooks that fired, in the order they first fired."""
        return hooks_fired(self.calls)

    def skipped_steps(self) -> list[int]:
        """The steps a veto skipped (this reads the flags from the device)."""
        return [step for step, flag in self._skipped if flag is not None and bool(flag)]

    @hookimpl(wrapper=True)
    def convert_model(self, ctx: ConvertContext) -> Iterator[None]:
        self._log("convert_model")
        return (yield)

    @hookimpl(wrapper=True)
    def wrap_model(self, ctx: ModelContext) -> Iterator[None]:
        self._log("wrap_model")
        return (yield)

    @hookimpl(wrapper=True)
    def compile_model(self, ctx: ModelContext) -> Iterator[None]:
        self._log("compile_model")
        return (yield)

    @hookimpl
    def build_optimizer(self, ctx: OptimizerContext) -> None:
        self._log("build_optimizer")

    @hookimpl(wrapper=True)
    def setup(self, ctx: SetupContext) -> Iterator[None]:
        self._log("setup")
        return (yield)

    @hookimpl
    def build_loss(self, ctx: SetupContext) -> None:
        self._log("build_loss")

    @hookimpl
    def loss_terms(self, ctx: LossContext) -> None:
        self._log("loss_terms", ctx)

    @hookimpl(wrapper=True)
    def pre_backward(self, ctx: StepContext) -> Iterator[None]:
        self._log("pre_backward", ctx)
        return (yield)

    @hookimpl(wrapper=True)
    def unscale_gradients(self, ctx: StepContext) -> Iterator[None]:
        self._log("unscale_gradients", ctx)
        return (yield)

    @hookimpl(wrapper=True)
    def observe_gradients(self, ctx: StepContext) -> Iterator[None]:
        self._log("observe_gradients", ctx)
        return (yield)

    @hookimpl(wrapper=True)
    def post_backward(self, ctx: StepContext) -> Iterator[None]:
        self._log("post_backward", ctx)
        return (yield)

    @hookimpl
    def pre_step(self, ctx: StepContext) -> None:
        self._log("pre_step", ctx)

    @hookimpl(wrapper=True)
    def post_step(self, ctx: StepContext) -> Iterator[None]:
        self._log("post_step", ctx)
        self._skipped.append((ctx.step, ctx.skipped))
        return (yield)

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> None:
        self._log("step_metrics", ctx)

    @hookimpl
    def validation_weights(self) -> None:
        self._log("validation_weights")

    @hookimpl(wrapper=True)
    def pre_validation(self, ctx: ValidationContext) -> Iterator[None]:
        self._log("pre_validation", ctx)
        return (yield)

    @hookimpl
    def validation_metrics(self, ctx: ValidationContext) -> None:
        self._log("validation_metrics", ctx)

    @hookimpl(wrapper=True)
    def post_validation(self, ctx: ValidationContext) -> Iterator[None]:
        self._log("post_validation", ctx)
        return (yield)

    @hookimpl
    def state_dict(self) -> dict[str, Any]:
        self._log("state_dict")
        return {"saved": 1}

    @hookimpl
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._log("load_state_dict")

    @hookimpl(wrapper=True)
    def checkpoint_saved(self, step: int) -> Iterator[None]:
        self.calls.append(("checkpoint_saved", step, None))
        return (yield)

    @hookimpl(wrapper=True)
    def checkpoint_loaded(self, step: int) -> Iterator[None]:
        self.calls.append(("checkpoint_loaded", step, None))
        return (yield)


@dataclass
class RunResult:
    """What a tiny run did, as :func:`tiny_run` returns it."""

    losses: dict[int, float]
    """The logged loss of each step (every step is a logging step unless ``args`` say not)."""
    metrics: list[dict]
    """The records of ``metrics.jsonl``, in order."""
    checksums: list[str]
    """Each rank's :func:`parameter_checksums` at the end of the run, by rank."""
    hooks: list[Call]
    """Rank 0's hook calls in order: ``(hook, step, microbatch)``."""
    skipped_steps: list[int]
    """The steps a veto skipped (on rank 0; vetoes must agree across ranks)."""
    dump_folder: Path
    per_rank: list[dict] = field(default_factory=list, repr=False)
    """Each rank's raw result (``checksum``, ``hooks``, ``skipped_steps``)."""

    def hooks_fired(self) -> list[str]:
        """The hooks that fired, in the order they first fired."""
        return hooks_fired(self.hooks)


def _train_one_rank(dump_folder: str, args: Sequence[str], steps: int, plugins: Plugins) -> dict:
    log = HookLog()
    trainer = make_trainer(dump_folder, *args, steps=steps, plugins=[*plugins, ("hook_log", log)])
    trainer.run()
    return {
        "rank": trainer.parallel_dims.rank,
        "checksum": parameter_checksums(trainer.model),
        "hooks": log.calls,
        "skipped_steps": log.skipped_steps(),
    }


def tiny_run(
    dump_folder: str | Path,
    *args: str,
    plugins: Plugins = (),
    steps: int = 3,
    world_size: int = 1,
) -> RunResult:
    """Train the tiny model ``steps`` steps on ``world_size`` processes; return what it did.

    ``args`` are config overrides (``"--plugins.enabled", "grad_clip"``, ``"--grad_clip.max_norm",
    "1.0"``); ``plugins`` are registered as :func:`make_trainer` says (plugin objects must be
    picklable when ``world_size > 1``). One process trains in this one; more are spawned and
    joined over gloo on the loopback interface.
    """
    folder = Path(dump_folder)
    if world_size == 1:
        ranks = [_train_one_rank(str(folder), args, steps, plugins)]
    else:
        ranks = run_distributed(_train_one_rank, world_size, str(folder), args, steps, plugins)
    records = read_metrics(folder)
    return RunResult(
        losses={r["step"]: r["loss"] for r in records if "loss" in r},
        metrics=records,
        checksums=[r["checksum"] for r in ranks],
        hooks=ranks[0]["hooks"],
        skipped_steps=ranks[0]["skipped_steps"],
        dump_folder=folder,
        per_rank=ranks,
    )
