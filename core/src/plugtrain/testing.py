"""The plugin author's test kit: tiny real runs, contexts, fault injection and cost checks.

Installing plugtrain registers this module as a pytest plugin (the ``pytest11`` entry point
``plugtrain``), so a plugin's own repository gets its fixtures with no ``conftest.py``; the
functions are imported as usual (``from plugtrain.testing import tiny_run``). A plugin's tests
need nothing else from the core than :mod:`plugtrain.plugin` and this module.

Runs:

* :func:`tiny_run` trains the tiny model for a few steps on the shipped sample (1 or more
  processes over gloo) with given plugins and config overrides, and returns a :class:`RunResult`:
  per-step losses, the metrics records, each rank's parameter checksum, the hooks fired in
  order and the skipped steps. The ``plugtrain_run`` fixture is the same, in ``tmp_path``.
* :func:`make_trainer` builds the :class:`~plugtrain.training.trainer.Trainer` of such a run for
  tests that drive it themselves; :func:`tiny_args` are its command-line arguments.
* :func:`run_distributed` calls a function on N spawned ranks; :func:`run_script` runs a
  training script as a user would (python, or torchrun for several processes).

Unit tests of one hook: :func:`step_context`, :func:`setup_context` and :func:`model_context`
build real contexts.

Faults: :class:`InjectInf` puts inf into the loss or one rank's gradients at given steps
(:func:`poison` does it by hand); :class:`SigtermAt` stops a run with SIGTERM on one rank, and
:func:`interrupted_and_resumed` checks that a stopped run resumes exactly.

Checks: :func:`count_costs` and :func:`assert_costs` (host syncs, collectives and time per
non-logging step, of the whole step or of one plugin's hooks); :func:`check_order_independence`
(the same parameters bitwise whatever the plugin's position among the enabled plugins).

Plugin objects handed to a multi-process run are pickled into spawned processes: define their
classes at module level. Functions handed to :func:`run_distributed` must be module level too,
in any module, test files included (a module that is not importable by name, as pytest's
``importlib`` mode leaves test files, is loaded from its file in each rank).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plugtrain.plugin import (
    LossContext,
    ModelContext,
    SetupContext,
    StepContext,
    ValidationContext,
    gradients,
    hookimpl,
    local_tensor,
)

__all__ = [
    "SAMPLE",
    "Costs",
    "HookLog",
    "InjectInf",
    "PeakMemory",
    "RunResult",
    "SigtermAt",
    "StepWatcher",
    "assert_costs",
    "check_order_independence",
    "count_costs",
    "free_port",
    "interrupted_and_resumed",
    "make_trainer",
    "model_context",
    "parameter_checksums",
    "plugtrain_run",
    "poison",
    "read_metrics",
    "run_distributed",
    "run_script",
    "setup_context",
    "step_context",
    "tiny_args",
    "tiny_run",
]

Plugins = Sequence[tuple[str, object | None]]
"""Plugins registered in this order: ``(name, plugin)``, or ``(name, None)`` to move the
enabled plugin ``name`` to that position."""


def _sample_folder() -> Path:
    override = os.environ.get("PLUGTRAIN_SAMPLE")
    if override:
        return Path(override)
    # The repository's data/ beside core/src/plugtrain/ (an editable install or a checkout).
    return Path(__file__).resolve().parents[3] / "data" / "shakespeare"


SAMPLE = _sample_folder()
"""The shipped Shakespeare sample (``tokenizer.json``, ``validation.jsonl``); the environment
variable ``PLUGTRAIN_SAMPLE`` names another folder holding the same two files."""


# --------------------------------------------------------------------------- tiny runs


def tiny_args(dump_folder: str | Path, *extra: str, steps: int = 3) -> list[str]:
    """Arguments for a run of the tiny model that takes about a second, then ``extra``.

    It trains on the (small) validation split to keep tokenisation fast, with validation off,
    and logs every step.
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
        *extra,
    ]  # fmt: skip


def make_trainer(dump_folder: str | Path, *args: str, steps: int = 3, plugins: Plugins = ()) -> Any:
    """The :class:`~plugtrain.training.trainer.Trainer` of a tiny run configured by ``args``.

    The plugins ``args`` enable (``--plugins.enabled``) are loaded first; then ``plugins`` are
    registered in exactly their order, after the enabled plugins they do not name. A pair
    ``(name, None)`` moves the enabled plugin ``name`` to its position, so a test controls the
    whole registration order: ``[("inject", InjectInf(...)), ("grad_scaler", None)]`` puts the
    injector before the scaler. (pluggy calls later registrations first within a hook.) A
    pair naming an enabled plugin with an object replaces the instance the run loaded.
    """
    from plugtrain.training.launch import configure
    from plugtrain.training.trainer import Trainer

    config, host = configure(tiny_args(dump_folder, *args, steps=steps))
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


def parameter_checksums(model: nn.Module) -> str:
    """A SHA-256 of this rank's parameter shards, bytes and all: equal means bitwise equal."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(local_tensor(param.detach()).contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()


class HookLog:
    """Logs every hook call of a run, in order, without changing the run.

    Every hook but ``config_section`` (which fires before any plugin object is registered) is
    implemented. The hooks pluggy fires are ``wrapper=True`` implementations that record
    ``(hook, step, microbatch)`` and yield, so they see the call before any plain
    implementation. The hooks the trainer calls plugin by plugin (``loss_terms``,
    ``step_metrics``, ``validation_weights``, ``state_dict``, ``load_state_dict``) are plain
    ones that add nothing; ``state_dict`` saves a constant, so that a resumed run fires
    ``load_state_dict``. Step and microbatch are None for hooks with no
    step. Each step's skip flag is kept and read only when asked (:meth:`skipped_steps`): a
    run with the log makes no extra host sync.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None, int | None]] = []
        self._skipped: list[tuple[int, torch.Tensor | None]] = []

    def _log(self, hook: str, ctx: StepContext | None = None) -> None:
        self.calls.append((hook, getattr(ctx, "step", None), getattr(ctx, "microbatch", None)))

    def hooks(self) -> list[str]:
        """The hooks that fired, in the order they first fired."""
        return list(dict.fromkeys(hook for hook, _, _ in self.calls))

    def skipped_steps(self) -> list[int]:
        """The steps a veto skipped (this reads the flags from the device)."""
        return [step for step, flag in self._skipped if flag is not None and bool(flag)]

    @hookimpl(wrapper=True)
    def wrap_model(self, ctx: ModelContext) -> Iterator[None]:
        self._log("wrap_model")
        return (yield)

    @hookimpl(wrapper=True)
    def compile_model(self, ctx: ModelContext) -> Iterator[None]:
        self._log("compile_model")
        return (yield)

    @hookimpl(wrapper=True)
    def setup(self, ctx: SetupContext) -> Iterator[None]:
        self._log("setup")
        return (yield)

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

    @hookimpl(wrapper=True)
    def pre_step(self, ctx: StepContext) -> Iterator[None]:
        self._log("pre_step", ctx)
        return (yield)

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
    hooks: list[tuple[str, int | None, int | None]]
    """Rank 0's hook calls in order: ``(hook, step, microbatch)``."""
    skipped_steps: list[int]
    """The steps a veto skipped (on rank 0; vetoes must agree across ranks)."""
    dump_folder: Path
    per_rank: list[dict] = field(default_factory=list, repr=False)
    """Each rank's raw result (``checksum``, ``hooks``, ``skipped_steps``)."""

    def hooks_fired(self) -> list[str]:
        """The hooks that fired, in the order they first fired."""
        return list(dict.fromkeys(hook for hook, _, _ in self.hooks))


def _train_one_rank(dump_folder: str, args: Sequence[str], steps: int, plugins: Plugins) -> dict:
    log = HookLog()
    trainer = make_trainer(dump_folder, *args, steps=steps, plugins=[*plugins, ("hook_log", log)])
    trainer.run()
    return {
        "rank": trainer.world.rank,
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


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_module(name: str, file: str | None) -> None:
    """Make module ``name`` importable in this process: import it, or load it from ``file``."""
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except ImportError:
        if file is None:
            raise
    # Parents first, as empty modules, so that pickle's __import__ of the dotted name works.
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None, file
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _worker(
    rank: int, world_size: int, port: int, out: str, module: tuple[str, str | None], payload: bytes
) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from plugtrain.distributed import destroy_world

    try:
        _load_module(*module)
        fn, args = pickle.loads(payload)
        result: Any = ("ok", fn(*args))
        destroy_world()
    except BaseException as e:  # reported to the parent, which re-raises
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        data = pickle.dumps(result)
    except Exception as e:
        data = pickle.dumps(("error", f"rank {rank}: its result cannot be pickled: {e}"))
    Path(out, f"rank{rank}.pkl").write_bytes(data)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` spawned ranks; return each rank's result, by rank.

    Each rank has ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (loopback,
    a free port), so a trainer built inside joins the others over gloo. ``fn`` must be a
    module-level function (it is pickled, as are ``args`` and the results) and must not
    swallow errors: an exception on any rank fails the caller with that rank's traceback.
    """
    import torch.multiprocessing as mp

    module = sys.modules[fn.__module__]
    where = (fn.__module__, getattr(module, "__file__", None))
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), out, where, payload),
            nprocs=world_size,
            start_method="spawn",
        )
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    errors = [message for status, message in results if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in results]


def run_script(
    script: str | Path,
    args: Sequence[str],
    nproc: int = 1,
    timeout: float = 300,
    *,
    env: dict[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Run a training script (``train.py``) as a user would: python for 1 process, torchrun
    for more; return its exit status and output.

    ``env`` adds environment variables; ``torchrun_args`` (``--max-restarts=1``) go to
    torchrun, which then runs even for one process. On a timeout it stops the run (SIGTERM,
    which torchrun passes on to its workers, then SIGKILL a minute later) and raises.
    """
    if nproc == 1 and not torchrun_args:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            *torchrun_args, str(script), *args,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: SIGKILL would leave torchrun's workers running, or hanging.
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


# --------------------------------------------------------------------------- contexts


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model(torch.ones(3, 4)).square().sum().backward()
    return model


def step_context(
    model: nn.Module | None = None,
    step: int = 1,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    num_microbatches: int = 1,
    microbatch: int = 0,
    loss: torch.Tensor | None = None,
    skipped: bool | None = None,
    skip_reasons: Sequence[str] = (),
    loss_scaler: str | None = None,
) -> StepContext:
    """A real :class:`~plugtrain.plugin.StepContext` for calling one hook in a unit test.

    Without ``model``, a small MLP whose gradients are already computed (deterministic: seed
    0). ``optimizer`` defaults to SGD over its parameters; ``skipped`` becomes the 0-d bool
    tensor ``post_step`` sees. The parameters are plain tensors, not FSDP2 DTensors: hooks
    that rely on DTensor placements need a real run (:func:`tiny_run`, :func:`make_trainer`).
    """
    model = _tiny_model() if model is None else model
    params = tuple(model.parameters())
    return StepContext(
        step=step,
        num_microbatches=num_microbatches,
        model=model,
        optimizer=optimizer if optimizer is not None else torch.optim.SGD(params, lr=0.1),
        params=params,
        loss_scaler=loss_scaler,
        microbatch=microbatch,
        loss=loss,
        skipped=None if skipped is None else torch.tensor(skipped),
        skip_reasons=list(skip_reasons),
    )


def _configured(plugins: dict[str, object] | None, args: Sequence[str]) -> tuple[Any, Any]:
    """A tiny run's validated config with ``args``, and ``name_of`` answering from ``plugins``."""
    from plugtrain.training.launch import configure

    configured = configure(tiny_args(tempfile.mkdtemp(prefix="plugtrain-setup-"), *args))
    assert configured is not None
    names = {id(obj): name for name, obj in (plugins or {}).items()}

    def name_of(plugin: object) -> str:
        return names[id(plugin)]

    return configured[0], name_of


def setup_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    model: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> SetupContext:
    """A real :class:`~plugtrain.plugin.SetupContext` for calling ``setup`` in a unit test.

    ``plugins`` maps the names the plugin objects run under to the objects (``name_of``
    answers from it); ``args`` are config overrides, validated as a run validates them
    (``"--plugins.enabled", "grad_clip", "--grad_clip.max_norm", "2"``), so
    ``ctx.plugin_config(plugin)`` returns the plugin's section. One process, the CPU, no mesh.
    """
    config, name_of = _configured(plugins, args)
    model = _tiny_model() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return SetupContext(
        config=config,
        model=model,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        device=torch.device("cpu"),
        mesh=None,  # type: ignore[arg-type]
        rank=0,
        world_size=1,
        name_of=name_of,
    )


def model_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    model: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
) -> ModelContext:
    """A real :class:`~plugtrain.plugin.ModelContext` for calling ``wrap_model`` or
    ``compile_model`` in a unit test.

    ``plugins`` and ``args`` as for :func:`setup_context`. The model is the tiny flavor's
    ``Transformer``, on the CPU and initialised (seed 0), unless ``model`` is given: the hooks
    can be checked by running it. One process, the CPU.
    """
    from plugtrain.model.transformer import FLAVORS, Transformer

    config, name_of = _configured(plugins, args)
    if model is None:
        model = Transformer(FLAVORS["tiny"])
        model.init_weights(seed=0)
    return ModelContext(
        config=config,
        model=model,
        blocks=tuple(model.layers),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        rank=0,
        world_size=1,
        name_of=name_of,
    )


# --------------------------------------------------------------------------- test plugins


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class InjectInf:
    """Puts inf into the loss or into one gradient element, on chosen steps and ranks.

    ``where="gradients"``: a ``wrapper=True`` implementation of ``unscale_gradients`` that
    writes ``value`` into this rank's shard of the first gradient before every plain
    implementation runs (a loss scaler's unscaling included), whatever the registration order.
    ``where="loss"``: a ``wrapper=True`` ``pre_backward`` that multiplies the loss by ``value``
    before a loss scaler sees it (every microbatch of the step), so every gradient is non-finite.
    """

    def __init__(
        self,
        steps: Collection[int],
        ranks: Collection[int] = (0,),
        where: str = "gradients",
        value: float = math.inf,
    ) -> None:
        if where not in ("gradients", "loss"):
            raise ValueError(f"where must be 'gradients' or 'loss', got {where!r}")
        self.steps, self.ranks, self.where, self.value = set(steps), set(ranks), where, value

    def _due(self, ctx: StepContext) -> bool:
        return ctx.step in self.steps and _rank() in self.ranks

    @hookimpl(wrapper=True)
    def pre_backward(self, ctx: StepContext) -> Iterator[None]:
        if self.where == "loss" and self._due(ctx) and ctx.loss is not None:
            ctx.loss = ctx.loss * self.value
        return (yield)

    @hookimpl(wrapper=True)
    def unscale_gradients(self, ctx: StepContext) -> Iterator[None]:
        if self.where == "gradients" and self._due(ctx):
            poison(ctx.model, self.value)
        return (yield)


def poison(model: nn.Module, value: float = math.inf) -> None:
    """Write ``value`` (inf, nan) into this rank's shard of the model's first gradient."""
    local_tensor(gradients(model)[0]).view(-1)[0] = value


class SigtermAt:
    """Sends its own process SIGTERM, on rank ``rank`` only, so that the run stops cleanly
    after step ``step`` (every rank agreeing, a checkpoint saved if checkpointing is on).

    On several processes the ranks' stop vote reads a step late (it never makes a step wait),
    so the signal goes out mid-step ``step - 1`` there.
    """

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank, self.my_rank = step, rank, -1

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.my_rank = ctx.rank
        self.step -= ctx.world_size > 1

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        if ctx.step == self.step and self.my_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


class StepWatcher:
    """Records, per step on this rank, whether the parameter shards and the optimizer state
    changed, and the LR schedule's count of applied steps.

    Set :attr:`trainer` before training (it reads the optimizer and the LR schedule). Its
    comparisons read tensors on the host: do not count costs with it registered.
    """

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer
        self.before: list[torch.Tensor] = []
        self.changed: dict[int, bool] = {}
        """Whether the step changed this rank's parameter shards."""
        self.state_changed: dict[int, bool] = {}
        """Whether it changed the optimizer state (created counts as changed: AdamW's first)."""
        self.lr_steps: dict[int, int] = {}
        """The LR schedule's applied steps after the step."""

    def _snapshot(self, ctx: StepContext) -> list[torch.Tensor]:
        tensors = [p.detach() for p in ctx.params]
        tensors += [v for state in ctx.optimizer.state.values() for v in state.values()]
        return [local_tensor(t).clone() for t in tensors]

    @hookimpl
    def pre_step(self, ctx: StepContext) -> None:
        self.before = self._snapshot(ctx)

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        after = self._snapshot(ctx)
        n = len(ctx.params)
        same = [torch.equal(a, b) for a, b in zip(self.before, after, strict=False)]
        self.changed[ctx.step] = not all(same[:n])
        self.state_changed[ctx.step] = len(after) != len(self.before) or not all(same[n:])
        if self.trainer is not None:
            self.lr_steps[ctx.step] = int(self.trainer.lr_scheduler.applied_steps)


# --------------------------------------------------------------------------- checks


class PeakMemory(TorchDispatchMode):
    """The peak bytes of the tensors that ops create while it is on, on any device.

    ``with PeakMemory() as memory: ...`` then ``memory.peak``: the CPU's stand-in for
    ``torch.cuda.max_memory_allocated``, counting each storage an op returns from its creation
    until it is freed (tensors that existed before, such as parameters, are not counted).
    Activation memory is what it tells apart: a forward and backward under it peaks at the
    activations kept for backward, plus the gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        """Bytes alive now."""
        self.peak = 0
        """The most bytes alive at once."""
        self._seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:  # a view of a counted tensor is not new memory
                    self._seen.add(storage)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def interrupted_and_resumed(
    dump_folder: str | Path,
    *args: str,
    steps: int = 8,
    stop_after: int = 4,
    sigterm_rank: int = 0,
    plugins: Callable[[], Plugins] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps straight; then the same run with checkpointing, stopped after
    ``stop_after`` steps by a SIGTERM only rank ``sigterm_rank`` gets, and resumed to the end.

    ``plugins`` makes fresh plugin objects for each of the three runs (a module-level function
    on several processes). Returns, on each rank: ``stopped_at`` and ``step_at_resume`` (both
    ``stop_after`` when the stop worked), ``straight`` and ``resumed`` (this rank's
    :func:`parameter_checksums`), ``plugins`` (the resumed run's objects, by name) and, on
    rank 0, ``straight_metrics`` and ``resumed_metrics``. A resumed run continues exactly when
    the checksums and the metrics are equal.
    """
    root = Path(dump_folder)
    fresh = plugins if plugins is not None else tuple

    def train(trainer: Any) -> Any:
        trainer.train()
        trainer.close()
        return trainer

    straight = train(make_trainer(root / "straight", *args, steps=steps, plugins=fresh()))
    checkpointed = (
        "--checkpoint.enable", "true", "--checkpoint.interval", str(steps),
        "--checkpoint.async_mode", "disabled", *args,
    )  # fmt: skip
    stop = [*fresh(), ("sigterm", SigtermAt(stop_after, sigterm_rank))]
    first = train(make_trainer(root / "resumed", *checkpointed, steps=steps, plugins=stop))
    resumed_plugins = list(fresh())
    second = make_trainer(root / "resumed", *checkpointed, steps=steps, plugins=resumed_plugins)
    step_at_resume = second.step
    train(second)
    result: dict[str, Any] = {
        "rank": second.world.rank,
        "stopped_at": first.step,
        "step_at_resume": step_at_resume,
        "straight": parameter_checksums(straight.model),
        "resumed": parameter_checksums(second.model),
        "plugins": dict(resumed_plugins),
    }
    if second.world.is_main:
        result["straight_metrics"] = read_metrics(root / "straight")
        result["resumed_metrics"] = read_metrics(root / "resumed")
    return result


@dataclass
class Costs:
    """What each extra, non-logging step cost, as :func:`count_costs` measured it."""

    syncs: float
    """Host syncs per step."""
    collectives: dict[str, float]
    """Collectives per step, by op (``"_c10d_functional.all_reduce"``); ops that cost 0 left out."""
    ms: float | None
    """Milliseconds per step in the plugin's hooks (None for a whole-step count)."""
    sync_sites: list[str]
    """Where the extra syncs happened (``"Tensor.item at module:line (function)"``)."""

    @property
    def num_collectives(self) -> float:
        """Collectives per step, all ops together."""
        return sum(self.collectives.values())


def _counted_run(
    dump_folder: Path, steps: int, args: Sequence[str], plugins: Plugins, plugin: str | None
) -> tuple[Counter[str], Counter[str], float]:
    from plugtrain.observability.costs import CostCounter

    argv = [*args, "--metrics.log_freq", "1000"]
    if plugin is not None:
        argv += ["--metrics.trace_hooks", "true"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        trainer = make_trainer(dump_folder, *argv, steps=steps, plugins=plugins)
    if plugin is None:
        with CostCounter() as costs:
            trainer.train()
        trainer.close()
        return costs.sync_sites, costs.collectives, 0.0
    trainer.train()
    trainer.close()
    trace = dump_folder / f"hook_trace.rank{trainer.world.rank}.jsonl"
    summary = json.loads(trace.read_text().splitlines()[-1])["summary"]
    sites: Counter[str] = Counter()
    collectives: Counter[str] = Counter()
    ms = 0.0
    for totals in summary["plugins"].get(plugin, {}).values():
        sites.update(totals.get("sync_sites", {}))
        collectives.update(totals.get("collective_ops", {}))
        ms += totals["ms"]
    return sites, collectives, ms


def count_costs(
    dump_folder: str | Path,
    *args: str,
    plugin: str | None = None,
    plugins: Plugins = (),
    short: int = 3,
    long: int = 6,
) -> Costs:
    """Host syncs, collectives (and time) per non-logging step, of a whole step or of the
    hooks of ``plugin``.

    Two runs of ``short`` and ``long`` steps log at their first and last steps only; the
    difference of their counts, over ``long - short``, is what one more non-logging step costs,
    so set-up, logging steps and the end of the run cancel out. With ``plugin`` (a registered
    plugin's name) only that plugin's hook implementations count, through the hook trace
    (``metrics.trace_hooks``); without, everything the step does counts (a
    :class:`~plugtrain.observability.costs.CostCounter` around ``train()``). Call it on
    every rank for a multi-process count (each rank counts its own).
    """
    folder = Path(dump_folder)
    s_sites, s_coll, s_ms = _counted_run(folder / "short", short, args, plugins, plugin)
    l_sites, l_coll, l_ms = _counted_run(folder / "long", long, args, plugins, plugin)
    extra = long - short
    l_coll.subtract(s_coll)
    sites = l_sites.copy()
    sites.subtract(s_sites)
    return Costs(
        syncs=(l_sites.total() - s_sites.total()) / extra,
        collectives={op: n / extra for op, n in l_coll.items() if n},
        ms=(l_ms - s_ms) / extra if plugin is not None else None,
        sync_sites=sorted(site for site, n in sites.items() if n > 0),
    )


def assert_costs(
    costs: Costs,
    *,
    syncs: float | None = 0,
    collectives: dict[str, float] | None = None,
    max_ms: float | None = None,
) -> None:
    """Fail unless ``costs`` are as declared: ``syncs`` host syncs per step, exactly the
    ``collectives`` by op (``{}`` for none; None: not checked), at most ``max_ms``."""
    if syncs is not None and costs.syncs != syncs:
        raise AssertionError(
            f"{costs.syncs:g} host syncs per non-logging step, expected {syncs:g}; "
            f"at: {costs.sync_sites}"
        )
    if collectives is not None and costs.collectives != collectives:
        raise AssertionError(
            f"collectives per non-logging step: {costs.collectives}, expected {collectives}"
        )
    if max_ms is not None and (costs.ms is None or costs.ms > max_ms):
        raise AssertionError(f"{costs.ms} ms per non-logging step, expected at most {max_ms}")


def check_order_independence(
    dump_folder: str | Path,
    plugin: str | tuple[str, Callable[[], object]],
    *args: str,
    others: Sequence[str] = (),
    steps: int = 3,
) -> list[str]:
    """Train once with ``plugin`` in every position among the ``others`` (installed plugins'
    names); fail unless the parameters are bitwise equal. Returns the checksum.

    ``plugin`` is an installed plugin's name or ``(name, factory)``, a fresh object per run.
    The registration order is set exactly (:func:`make_trainer`), so each position is one the
    contract allows; ``args`` go to every run.
    """
    name = plugin if isinstance(plugin, str) else plugin[0]
    installed = [*others, name] if isinstance(plugin, str) else list(others)
    enabled = ("--plugins.enabled", ",".join(installed)) if installed else ()
    sums: dict[tuple[str, ...], str] = {}
    for position in range(len(others) + 1):
        order = [*others[:position], name, *others[position:]]
        registered = [
            (n, plugin[1]() if n == name and not isinstance(plugin, str) else None) for n in order
        ]
        trainer = make_trainer(
            Path(dump_folder, str(position)), *enabled, *args, steps=steps, plugins=registered
        )
        trainer.train()
        trainer.close()
        sums[tuple(order)] = parameter_checksums(trainer.model)
    if len(set(sums.values())) > 1:
        raise AssertionError(f"the parameters depend on the registration order: {sums}")
    return sorted(set(sums.values()))


# --------------------------------------------------------------------------- pytest fixtures


@pytest.fixture
def plugtrain_run(tmp_path: Path) -> Callable[..., RunResult]:
    """:func:`tiny_run` in a fresh folder of ``tmp_path``: ``plugtrain_run(*args, plugins=...,
    steps=..., world_size=...)``; each call trains in a folder of its own."""
    calls = iter(range(1_000_000))

    def run(*args: str, **kwargs: Any) -> RunResult:
        return tiny_run(tmp_path / f"run{next(calls)}", *args, **kwargs)

    return run


_TEST_CACHE: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Give the session its own data cache (``PLUGTRAIN_CACHE``), unless one is set: tests
    must not write to the user's ``~/.cache``; child processes inherit it."""
    global _TEST_CACHE
    if "PLUGTRAIN_CACHE" not in os.environ:
        _TEST_CACHE = tempfile.mkdtemp(prefix="plugtrain-cache-")
        os.environ["PLUGTRAIN_CACHE"] = _TEST_CACHE


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's data cache, if :func:`pytest_configure` made it."""
    if _TEST_CACHE is not None and os.environ.get("PLUGTRAIN_CACHE") == _TEST_CACHE:
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)
        del os.environ["PLUGTRAIN_CACHE"]
