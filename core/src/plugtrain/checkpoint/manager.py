"""Checkpoints: save a run, resume it exactly, survive crashes and preemption.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) folder; each rank writes its own shard
of the model and optimizer state. The layout under ``<job.dump_folder>/checkpoints/``::

    step-200/            complete checkpoints, the only ones a run ever loads
    step-300.partial/    being written (or left by a crash): never loaded, removed later
    step-100.deleting/   being pruned: never loaded

A save writes ``step-<N>.partial/``, waits until every rank has finished writing (a barrier),
then rank 0 renames it to ``step-<N>/``. A rename is atomic, so a crash at any moment leaves
either the complete checkpoint or none, and never touches the previous one.

What a checkpoint holds (the keys of the DCP state dict): ``model`` and ``optimizer`` (from
``get_state_dict``, sharded DTensors), ``lr_scheduler``, ``data`` (the loader's position),
``train`` (the trainer's counters: step, tokens seen, skipped steps), ``world`` (the number of
ranks that saved it), ``rng.rank<R>`` (each rank's torch,
CUDA, Python and NumPy generator states) and ``plugins.<name>`` (each stateful plugin's
``state_dict`` hook). Numbers are stored as 0-d tensors, so a checkpoint holds tensors only:
loading never unpickles an object (tensors go through ``torch.load(weights_only=True)``, DCP's
``.metadata`` file through an unpickler that admits DCP's own metadata classes only). Beside
them, ``config.json`` holds the resolved config of the run that saved it (written into the
``.partial`` folder, so it is committed with it): a resume that changes a setting the run must
keep (``config.FIXED_ON_RESUME``) is refused, naming the key.

Resuming reshards: the model and optimizer may be loaded on another number of ranks, and the
data loader's position does not depend on it; only the RNG streams of ranks the checkpoint did
not have start afresh.

A run deletes only checkpoints it wrote itself (the ``keep_latest_k`` oldest) and crash
leftovers. Starting afresh, or resuming from an earlier step, in a folder holding later complete
checkpoints is refused unless ``checkpoint.discard_later`` asks to delete them; a save never
replaces a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from plugtrain.checkpoint.dcp_io import (
    SafeFileSystemReader,
    TensorOnlyLoadPlanner,
    flat_keys,
    from_tensors,
    read_metadata,
    to_tensors,
)
from plugtrain.checkpoint.faults import Fault
from plugtrain.checkpoint.layout import CONFIG, checkpoint_folder, complete_checkpoints
from plugtrain.checkpoint.rng import rng_state, set_rng_state
from plugtrain.config import CheckpointConfig, fixed_on_resume
from plugtrain.distributed import World
from plugtrain.errors import CheckpointError, one_line
from plugtrain.host import PluginHost

logger = logging.getLogger("plugtrain")

_PARTIAL, _DELETING = ".partial", ".deleting"


# --------------------------------------------------------------------------- the folder


def _delete(path: Path) -> None:
    """Remove a checkpoint folder; renamed first, so a half-deleted one is never loaded."""
    doomed = path.with_name(path.name + _DELETING)
    if doomed.exists():  # left by a crash while deleting it before
        shutil.rmtree(doomed)
    path.rename(doomed)
    shutil.rmtree(doomed)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Let a KeyboardInterrupt (a second Ctrl-C) out of DCP, which wraps it into an error."""
    try:
        yield
    except dcp.CheckpointException as e:
        if any(isinstance(exc, KeyboardInterrupt) for exc, _ in e.failures.values()):
            raise KeyboardInterrupt from None
        raise


_NEARLY_FULL = 2**20
"""Free bytes below which a disk counts as full, for a write error that gives no cause."""


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` or its nearest existing parent."""
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def _write_failure_cause(error: BaseException | None, free: int | None) -> str:
    """Why writing a checkpoint failed, in a few words (``No space left on device``).

    An OSError says it with its strerror. torch's zip writer reports a full disk as a
    RuntimeError ("unexpected pos", "file write failed") without an errno: a disk (nearly)
    full once it failed is taken for the cause then.
    """
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error  # DCP: rank -> (error, tb)
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    if free is not None and free < _NEARLY_FULL:
        return os.strerror(errno.ENOSPC)
    return one_line(error) if error is not None else "rank 0 could not create its folder"


# --------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Restores a run at start-up and saves it on schedule, when the run stops early, and at
    the end.

    It is given the pieces it saves, never the trainer: the model and optimizer (saved through
    DCP's ``get_state_dict``, sharded), ``states`` (objects with ``state_dict`` and
    ``load_state_dict``, saved under their key: the LR schedule, the data loader, the trainer's
    counters) and the plugin host (each plugin's ``state_dict`` hook). ``run_config`` is the
    run's resolved config as plain data (``JobConfig.to_dict``), saved with each checkpoint.

    The trainer calls :meth:`load` once, after plugin setup; :meth:`after_step` after every
    optimizer step (it saves when due); :meth:`close` at the end, or :meth:`abort` after an
    error. With ``checkpoint.enable`` off, each is a no-op. Every method but :meth:`abort` is
    collective: all ranks call it.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        dump_folder: str | os.PathLike[str],
        world: World,
        total_steps: int,
        model: nn.Module,
        optimizer: Optimizer,
        states: Mapping[str, Stateful],
        host: PluginHost,
        run_config: Mapping[str, Any],
    ) -> None:
        self.config = config
        self.run_config = run_config
        self.resumed_from: dict[str, Any] | None = None
        """The checkpoint :meth:`load` resumed from, ``{"path", "step"}``; None for a new run."""
        self.folder = checkpoint_folder(dump_folder)
        self.world = world
        self.total_steps = total_steps
        self.model, self.optimizer = model, optimizer
        self.states = dict(states)
        self.host = host
        self._pending: Future[None] | None = None
        self._pending_save: tuple[Path, int] | None = None
        """The folder and step of the save in flight, for ``checkpoint_saved``."""
        self._executor: ThreadPoolExecutor | None = None
        self._control_group: dist.ProcessGroup | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._faults = Fault.from_env(self.world.rank)
        if not self.config.enable:
            return
        if self.world.world_size > 1:
            # A CPU (gloo) group for the save barriers, whatever the training backend: a few
            # bytes over TCP, no device synchronisation.
            self._control_group = dist.new_group(backend="gloo")
        if self.config.async_mode == "async":
            # The background save runs DCP's collectives; on a group of their own they
            # never interleave with the training loop's.
            self._async_group = dist.new_group(backend="gloo")
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="plugtrain-checkpoint")

    # ----------------------------------------------------------------------- saving

    def after_step(self, step: int, stop: bool) -> None:
        """Save if ``step``, just taken, is due: every ``checkpoint.interval`` steps, the last
        step, or the run stops after it (``stop``: a signal, see ``training/stop.py``)."""
        if not self.config.enable:
            return
        for fault in self._faults:
            fault.fire("after_step", step)
        if stop or step == self.total_steps or step % self.config.interval == 0:
            self.save(step)

    def save(self, step: int) -> None:
        """Write a checkpoint of the run as it is after ``step``.

        A save that fails (a full disk) removes its partial folder and raises a one-line
        :class:`CheckpointError` naming the cause; the complete checkpoints stay as they are.
        """
        self.wait()
        final = self.folder / f"step-{step}"
        if final.exists():
            raise self._exists_error(final)
        partial = final.with_name(final.name + _PARTIAL)
        start = time.perf_counter()
        failure: OSError | None = None
        if self.world.is_main:
            try:
                if partial.exists():  # left by a crash while saving this very step
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
                (partial / CONFIG).write_text(json.dumps(self.run_config, indent=2) + "\n")
            except OSError as e:
                failure = e
        # Asked of every rank rather than a barrier, so that all stop when rank 0 cannot start.
        if self._any_rank(failure is not None):
            raise self._save_failed(final, partial, failure) from failure
        state = self._storable(
            self._state(with_rng=True, plugins=None, optimizer_state=bool(self.optimizer.state))
        )
        writer = FileSystemWriter(partial)
        if self._executor is None:
            try:
                with _interruptible():
                    dcp.save(state, storage_writer=writer)
            except (Exception, dcp.CheckpointException) as e:
                raise self._save_failed(final, partial, e) from e
            self._commit(step, partial, final, start, self._control_group)
            self.host.hook.checkpoint_saved(folder=final, step=step)
            return
        try:
            with _interruptible():
                upload = dcp.async_save(
                    state, storage_writer=writer, process_group=self._async_group
                )
        except (Exception, dcp.CheckpointException) as e:
            raise self._save_failed(final, partial, e) from e
        logger.info(
            "checkpoint step-%d copied in %.2f s, writing it in the background",
            step,
            time.perf_counter() - start,
        )
        self._pending = self._executor.submit(
            self._commit_when_written, upload, step, partial, final, start
        )
        self._pending_save = (final, step)

    def _commit_when_written(
        self, upload: Future, step: int, partial: Path, final: Path, start: float
    ) -> None:
        try:
            upload.result()
        except (Exception, dcp.CheckpointException) as e:
            raise self._save_failed(final, partial, e) from e
        self._commit(step, partial, final, start, self._async_group)

    def _save_failed(
        self, final: Path, partial: Path, error: BaseException | None
    ) -> CheckpointError:
        """The one-line error for a failed save, once rank 0 has removed what it wrote."""
        free = _free_bytes(self.folder)
        cause = _write_failure_cause(error, free)
        if self.world.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        space = "" if free is None else f" ({free / 2**20:.1f} MiB free in {self.folder})"
        return CheckpointError(
            f"cannot save checkpoint {final}: {cause}{space}; the previous checkpoints are "
            "intact: free space or set job.dump_folder elsewhere"
        )

    def _commit(
        self, step: int, partial: Path, final: Path, start: float, group: dist.ProcessGroup | None
    ) -> None:
        """Once every rank has written its shard, make the checkpoint visible (rank 0)."""
        for fault in self._faults:
            fault.fire("before_commit", step)
        self._barrier(group)
        if self.world.is_main:
            if final.exists():  # appeared since save() looked: another run writes here too
                raise self._exists_error(final)
            partial.rename(final)
        # So that on every rank a returned save is a visible one.
        self._barrier(group)
        if not self.world.is_main:
            return
        logger.info(
            "checkpoint step-%d saved in %.2f s, %.1f MiB: %s",
            step,
            time.perf_counter() - start,
            _folder_bytes(final) / 2**20,
            final,
        )
        self._prune(step)

    def _exists_error(self, final: Path) -> CheckpointError:
        # Start-up refuses later checkpoints, so this one was written by another run since.
        return CheckpointError(
            f"cannot save {final}: a complete checkpoint of that step already exists, written by "
            "another run using the same job.dump_folder; give each run its own job.dump_folder"
        )

    def _prune(self, step: int) -> None:
        """Delete what a crash left behind and all but the newest ``keep_latest_k`` checkpoints
        up to ``step``; a later one is never deleted here (start-up refuses them)."""
        for path in self.folder.iterdir():
            if path.name.endswith((_PARTIAL, _DELETING)):
                shutil.rmtree(path)
        keep = self.config.keep_latest_k
        steps = [s for s in complete_checkpoints(self.folder) if s <= step]
        old = steps[:-keep] if keep else []
        for s in old:
            _delete(self.folder / f"step-{s}")
        if old:
            logger.info(
                "deleted %s (keep_latest_k %d)",
                ", ".join(f"step-{s}" for s in old),
                self.config.keep_latest_k,
            )

    def wait(self) -> None:
        """Block until an async save in flight is written and committed (re-raising its error),
        then fire ``checkpoint_saved`` for it: here, on the main thread of every rank."""
        pending, self._pending = self._pending, None
        saved, self._pending_save = self._pending_save, None
        if pending is not None and saved is not None:
            pending.result()
            self.host.hook.checkpoint_saved(folder=saved[0], step=saved[1])

    def close(self) -> None:
        """Finish any save in flight (collective)."""
        try:
            self.wait()
        finally:
            self.abort()

    def abort(self) -> None:
        """After an error: abandon a save in flight without waiting for it (its collectives
        may wait for a rank that failed); it stays ``.partial``, never loaded (idempotent)."""
        self._pending = self._pending_save = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (collective, on the control group)."""
        if self._control_group is None:
            return flag
        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._control_group)
        return bool(vote.item())

    def _barrier(self, group: dist.ProcessGroup | None) -> None:
        if self.world.world_size > 1:
            dist.barrier(group=group)

    # ----------------------------------------------------------------------- the state

    def _state(
        self, with_rng: bool, plugins: set[str] | None, optimizer_state: bool
    ) -> dict[str, Any]:
        """The run's state as nested dicts of tensors and numbers (live tensors: DCP loads
        into them). ``with_rng`` adds this rank's generators; ``plugins`` restricts the
        plugins' states to those names (None: every plugin that has state);
        ``optimizer_state`` False leaves the optimizer's per-parameter state out, for an
        optimizer that has not stepped yet (every step so far vetoed)."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        if not optimizer_state:
            # NOTE: get_state_dict gives an optimizer that has not stepped a state by taking a
            # zero-lr step; the run must go on as if it had not (AdamW counts its steps).
            self.optimizer.state.clear()
            optimizer = {**optimizer, "state": {}}
        plugin_states = self.host.results("state_dict")
        if plugins is not None:
            plugin_states = {k: v for k, v in plugin_states.items() if k in plugins}
        state = {
            "model": model,
            "optimizer": optimizer,
            **{key: stateful.state_dict() for key, stateful in self.states.items()},
            "world": {"size": self.world.world_size},
            "plugins": plugin_states,
        }
        if with_rng:
            state["rng"] = {f"rank{self.world.rank}": rng_state(self.world.device)}
        return state

    @staticmethod
    def _storable(state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as tensors only (:func:`to_tensors`).

        An optimizer param group's ``params`` are parameter names, which the model that
        loads the checkpoint supplies: they are left out rather than pickled.
        """
        optimizer = state["optimizer"]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        return to_tensors({**state, "optimizer": {**optimizer, "param_groups": groups}})

    # ----------------------------------------------------------------------- loading

    def load(self) -> None:
        """Resume from the checkpoint ``checkpoint.load_step`` picks, if any.

        Complete checkpoints after the one picked (all of them for ``load_step`` 0) belong to
        a run this one would overwrite: refused, or with ``checkpoint.discard_later`` deleted
        once the resume has succeeded."""
        if not self.config.enable:
            return
        # Every rank lists the folder itself: DCP's file system storage already needs
        # one folder that all ranks see.
        available = complete_checkpoints(self.folder)
        chosen = self._choose(available)
        later = [s for s in available if chosen is None or s > chosen]
        if later and not self.config.discard_later:
            raise self._later_error(chosen, later)
        if chosen is not None:
            self._load(available[chosen])
        elif self.config.load_step == 0:
            logger.info("starting afresh (checkpoint.load_step 0)")
        else:
            logger.info("no checkpoint to resume from in %s: training from step 0", self.folder)
        if later:
            if self.world.is_main:
                for s in later:
                    _delete(available[s])
                logger.info(
                    "deleted %s (checkpoint.discard_later)", ", ".join(f"step-{s}" for s in later)
                )
            self._barrier(self._control_group)

    def latest_at_most(self, at_most: int) -> int:
        """The step of the latest complete checkpoint at step ``at_most`` or earlier; a one-line
        :class:`CheckpointError` if there is none."""
        available = complete_checkpoints(self.folder)
        earlier = [s for s in available if s <= at_most]
        if not earlier:
            steps = ", ".join(map(str, available)) or "none"
            raise CheckpointError(
                f"cannot rewind to step {at_most} or earlier: {self.folder} has no complete "
                f"checkpoint there (complete ones: {steps}); save more often "
                "(checkpoint.interval) or keep more (checkpoint.keep_latest_k)"
            )
        return earlier[-1]

    def rewind(self, at_most: int) -> int:
        """Go back to the latest complete checkpoint at step ``at_most`` or earlier, delete the
        later ones, and return its step (collective).

        The later checkpoints go only once the load has succeeded: a crash before leaves them,
        and the caller's record of the rewind (``data_skips.json``) has it done again.
        """
        self.wait()
        chosen = self.latest_at_most(at_most)
        self._load(self.folder / f"step-{chosen}")
        if self.world.is_main:
            for s, path in complete_checkpoints(self.folder).items():
                if s > chosen:
                    _delete(path)
        self._barrier(self._control_group)
        return chosen

    def _choose(self, available: Mapping[int, Path]) -> int | None:
        """The step to resume from, None to start afresh."""
        load_step = self.config.load_step
        if load_step == 0:
            return None
        if load_step > 0:
            if load_step not in available:
                steps = ", ".join(map(str, available)) or "none"
                raise CheckpointError(
                    f"checkpoint.load_step is {load_step}, but {self.folder} has no complete "
                    f"checkpoint step-{load_step} (complete ones: {steps}): pick one of them, "
                    "or -1 for the latest"
                )
            return load_step
        return max(available) if available else None

    def _later_error(self, chosen: int | None, later: list[int]) -> CheckpointError:
        steps = ", ".join(map(str, later))
        if chosen is None:
            return CheckpointError(
                f"checkpoint.load_step is 0 (start afresh), but {self.folder} holds checkpoints "
                f"of an earlier run (steps {steps}): train in another job.dump_folder, or add "
                "--checkpoint.discard_later true to delete them"
            )
        return CheckpointError(
            f"checkpoint.load_step is {chosen}, but {self.folder} holds later checkpoints "
            f"(steps {steps}) that this run would overwrite: resume from the latest with "
            "--checkpoint.load_step -1, or add --checkpoint.discard_later true to delete them"
        )

    def _load(self, path: Path) -> None:
        start = time.perf_counter()
        metadata = read_metadata(path)
        saved = metadata.state_dict_metadata
        in_checkpoint = {key.split(".")[1] for key in saved if key.startswith("plugins.")}
        loaders = set(self.host.implementers("load_state_dict"))
        rank_rng = f"rng.rank{self.world.rank}."
        has_rng = any(key.startswith(rank_rng) for key in saved)
        template = self._state(
            with_rng=has_rng,
            plugins=in_checkpoint & loaders,
            optimizer_state=any(key.startswith("optimizer.state.") for key in saved),
        )
        storable = self._storable(template)
        self._check(path, saved, flat_keys(storable), template["plugins"])
        self._check_settings(path)
        try:
            dcp.load(
                storable,
                storage_reader=SafeFileSystemReader(path),
                planner=TensorOnlyLoadPlanner(),
            )
        except (Exception, dcp.CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {one_line(e)}; delete it to resume from the one "
                "before, or pick one with --checkpoint.load_step"
            ) from e
        state = from_tensors(template, storable)
        self._apply(state)
        for name, plugin_state in state["plugins"].items():
            self.host.call_one(name, "load_state_dict", state_dict=plugin_state)
        train, saved_world = state["train"], state["world"]["size"]
        self.resumed_from = {"path": str(path), "step": train["step"]}
        self.host.hook.checkpoint_loaded(folder=path, step=train["step"])
        if self.world.is_main:
            ignored = sorted(in_checkpoint - loaders)
            if ignored:
                logger.info("checkpoint state of plugins not active in this run, ignored: %s",
                            ", ".join(ignored))  # fmt: skip
            if saved_world != self.world.world_size:
                logger.warning(
                    "resharding checkpoint of %d ranks onto %d: model, optimizer and data "
                    "continue; random generators of ranks it did not have start afresh",
                    saved_world,
                    self.world.world_size,
                )
        logger.info(
            "resumed from %s (step %d, %d tokens seen) in %.2f s",
            path,
            train["step"],
            train["tokens_seen"],
            time.perf_counter() - start,
        )

    def _check(
        self,
        path: Path,
        saved: Mapping[str, Any],
        wanted: Mapping[str, torch.Tensor],
        plugin_states: Mapping[str, Any],
    ) -> None:
        """Refuse, with one line, a checkpoint this run cannot continue from."""

        def refuse(why: str) -> CheckpointError:
            return CheckpointError(
                f"checkpoint {path} was saved from another model: {why}; resume with the "
                "model.flavor and tokenizer it was trained with, or train in another "
                "job.dump_folder"
            )

        model_saved = {k for k in saved if k.startswith("model.")}
        model_wanted = {k for k in wanted if k.startswith("model.")}
        for key in sorted(model_saved & model_wanted):
            if list(saved[key].size) != list(wanted[key].shape):
                raise refuse(
                    f"parameter '{key.removeprefix('model.')}' has shape "
                    f"{list(saved[key].size)} there and {list(wanted[key].shape)} here"
                )
        if missing := sorted(model_wanted - model_saved):
            raise refuse(f"it has no parameter '{missing[0].removeprefix('model.')}'")
        if extra := sorted(model_saved - model_wanted):
            raise refuse(f"its parameter '{extra[0].removeprefix('model.')}' is not in this model")
        for name in plugin_states:
            prefix = f"plugins.{name}."
            there = {k for k in saved if k.startswith(prefix)}
            here = {k for k in wanted if k.startswith(prefix)}
            if there != here:
                raise CheckpointError(
                    f"checkpoint {path} holds state of plugin '{name}' with keys "
                    f"{sorted(k.removeprefix(prefix) for k in there)}, but the plugin's state now "
                    f"has {sorted(k.removeprefix(prefix) for k in here)}: use the plugin version "
                    "that saved it, or disable the plugin"
                )
        for key in wanted:
            if key not in saved:
                raise CheckpointError(
                    f"checkpoint {path} lacks '{key}': it was not written by this version of "
                    "plugtrain; pick another with --checkpoint.load_step"
                )
            if not isinstance(saved[key], TensorStorageMetadata):
                raise CheckpointError(
                    f"checkpoint {path} stores '{key}' as a pickled object, which plugtrain never "
                    "loads: use a checkpoint written by plugtrain"
                )

    def _check_settings(self, path: Path) -> None:
        """Refuse, with one line, a resume that changes a setting the run must keep."""
        try:
            saved = json.loads((path / CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {path} is damaged: cannot read its {CONFIG} ({one_line(e)}); delete "
                "it to resume from the one before, or pick one with --checkpoint.load_step"
            ) from e
        theirs = fixed_on_resume(saved)
        for key, value in fixed_on_resume(self.run_config).items():
            if key in theirs and theirs[key] != value:
                raise CheckpointError(
                    f"{key} is {value!r} in this run but {theirs[key]!r} in checkpoint {path}, "
                    f"and a resumed run keeps the settings it started with: drop --{key} (or set "
                    "it back), or start a new run in another job.dump_folder"
                )

    def _apply(self, state: Mapping[str, Any]) -> None:
        """Put a loaded state into the model, optimizer, the other stateful pieces and RNGs."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        if not state["optimizer"]["state"]:  # saved before the optimizer's first step
            self.optimizer.state.clear()
        for key, stateful in self.states.items():
            stateful.load_state_dict(state[key])
        if "rng" in state:
            set_rng_state(state["rng"][f"rank{self.world.rank}"], self.world.device)
