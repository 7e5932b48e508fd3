"""Checkpoints: save a run, resume it exactly, survive crashes and preemption.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) ones, one per step; each rank writes its
own shard of the model and optimizer state. The manager decides when to save, what
state to gather and what to resume from; everything that touches the medium goes through a
:class:`~plugtrain.checkpoint.storage.CheckpointStorage` (``LocalStorage``:
``<job.dump_folder>/checkpoints/step-<N>/``; ``FsspecStorage`` for an ``s3://`` dump folder).
A save stages the checkpoint, waits until every rank has finished writing its shard (a
barrier), then rank 0 commits it, atomically: a crash at any moment leaves either the complete
checkpoint or none, and never touches the previous one.

What a checkpoint holds (the keys of the DCP state dict): ``model`` and ``optimizer`` (from
``get_state_dict``, sharded DTensors), ``lr_scheduler``, ``data`` (the loader's position),
``train`` (the trainer's counters: step, tokens seen, skipped steps), ``world`` (the number of
ranks that saved it), ``rng.rank<R>`` (each rank's torch,
CUDA, Python and NumPy generator states) and ``plugins.<name>`` (each stateful plugin's
``state_dict`` hook); a run that leaves a frozen base out (``checkpoint.base``) holds
``base.sha256`` instead of the base's ``model`` keys. Numbers are stored as 0-d tensors,
so a checkpoint holds tensors only: loading never unpickles an object (tensors go through
``torch.load(weights_only=True)``, DCP's ``.metadata`` file through an unpickler that admits
DCP's own metadata classes only). Beside them, ``config.json`` holds the resolved config
of the run that saved it (staged first, so it is committed with it): a resume that changes a
setting the run must keep (``config.FIXED_ON_RESUME``, and a plugin config's own
``FIXED_ON_RESUME``) is refused, naming the key.

Resuming reshards: the model and optimizer may be loaded on another number of ranks, and the
data loader's position does not depend on it; only the RNG streams of ranks the checkpoint did
not have start afresh.

Without ``checkpoint.enable`` a run saves its last step alone (``checkpoint.save_final``), the
same checkpoint, so that every run leaves a model to generate from, export and evaluate; it
refuses a dump folder that already holds checkpoints (unless ``checkpoint.discard_later``),
which it would neither resume nor keep apart from its own.

A run deletes only checkpoints it wrote itself (the ``keep_latest_k`` oldest) and crash
leftovers. Starting afresh, or resuming from an earlier step, in a folder holding later complete
checkpoints is refused unless ``checkpoint.discard_later`` asks to delete them; a save never
replaces a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from plugtrain.checkpoint.base import DIGEST_KEY, check_digest, left_out, source_digest
from plugtrain.checkpoint.checks import (
    check_optimizer,
    check_settings,
    check_state,
    choose,
    exists_error,
    latest_at_most,
    save_failed,
)
from plugtrain.checkpoint.dcp_io import (
    TensorOnlyLoadPlanner,
    damaged,
    flat_keys,
    from_tensors,
    read_metadata,
    to_tensors,
)
from plugtrain.checkpoint.faults import Fault
from plugtrain.checkpoint.initial import InitialLoad, open_initial_load
from plugtrain.checkpoint.layout import CONFIG
from plugtrain.checkpoint.object_store import open_storage
from plugtrain.checkpoint.records import chat_template_files
from plugtrain.checkpoint.rng import rng_state, set_rng_state
from plugtrain.checkpoint.storage import CheckpointStorage
from plugtrain.config import CheckpointConfig, JobConfig
from plugtrain.data import ChatTemplate
from plugtrain.distributed import ParallelDims
from plugtrain.errors import CheckpointError, one_line
from plugtrain.model import conversion_of

logger = logging.getLogger("plugtrain")


class PluginStates(Protocol):
    """What the manager asks of the plugin host (``plugtrain.host.PluginHost``, a floor above):
    each plugin's ``state_dict`` answer, its ``load_state_dict`` and the checkpoint hooks."""

    hook: Any
    """The hooks by name (pluggy's relay): ``checkpoint_saved``, ``checkpoint_loaded``."""

    def results(self, hook_name: str, **kwargs: Any) -> dict[str, Any]: ...
    def implementers(self, hook_name: str) -> list[str]: ...
    def call_one(self, name: str, hook_name: str, **kwargs: Any) -> None: ...


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Let a KeyboardInterrupt (a second Ctrl-C) out of DCP, which wraps it into an error."""
    try:
        yield
    except dcp.CheckpointException as e:
        if any(isinstance(exc, KeyboardInterrupt) for exc, _ in e.failures.values()):
            raise KeyboardInterrupt from None
        raise


# --------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Restores a run at start-up and saves it on schedule, when the run stops early, and at
    the end.

    It is given the pieces it saves, never the trainer: the model and optimizer (saved through
    DCP's ``get_state_dict``, sharded), ``states`` (objects with ``state_dict`` and
    ``load_state_dict``, saved under their key: the LR schedule, the data loader, the trainer's
    counters) and the plugin host (:class:`PluginStates`: each plugin's ``state_dict`` hook).
    ``run_config`` is the run's resolved config, saved as plain data (``JobConfig.to_dict``)
    with each checkpoint, and so is ``chat_template``, the template the run's chat data was
    rendered with (``checkpoint.saved`` reads both back).

    The trainer calls :meth:`load` once, after plugin setup; :meth:`after_step` after every
    optimizer step (it saves when due); :meth:`close` at the end, or :meth:`abort` after an
    error. With ``checkpoint.enable`` off only the last step is saved
    (``checkpoint.save_final``), and with both off each is a no-op. Every method but
    :meth:`abort` is collective: all ranks call it.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        dump_folder: str | os.PathLike[str],
        dims: ParallelDims,
        total_steps: int,
        model: nn.Module,
        optimizer: Optimizer,
        states: Mapping[str, Stateful],
        host: PluginStates,
        run_config: JobConfig,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.config = config
        self.run_config = run_config.to_dict()
        self.plugins_fixed = run_config.plugins_fixed_on_resume()
        """The settings the enabled plugins keep on resume, by section."""
        self.run_files = chat_template_files(chat_template)
        self.resumed_from: dict[str, Any] | None = None
        """The checkpoint :meth:`load` resumed from, ``{"path", "step"}``; None for a new run."""
        self.storage: CheckpointStorage = open_storage(
            dump_folder, config.endpoint_url, config.store_retries
        )
        self.dims = dims
        self.total_steps = total_steps
        self.model, self.optimizer = model, optimizer
        self.left_out = left_out(model, config)
        """Frozen parameters the checkpoints leave out, re-read from the initial load."""
        self._base: tuple[InitialLoad, torch.Tensor] | None = None
        self.states = dict(states)
        self.host = host
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        """The step of the save in flight, for ``checkpoint_saved``."""
        self._executor: ThreadPoolExecutor | None = None
        self._control_group: dist.ProcessGroup | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._faults = Fault.from_env(self.dims.rank)
        self.saves = config.enable or config.save_final
        """Whether the run saves any checkpoint (every one, or its last step's alone)."""
        if not self.saves:
            return
        self.storage.check()
        if self.dims.world_size > 1:
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
        step, or the run stops after it (``stop``: a signal, see ``training/stop.py``); with
        ``checkpoint.enable`` off, the last step only (``checkpoint.save_final``)."""
        if not self.config.enable:
            if self.config.save_final and step == self.total_steps:
                self.save(step)
            return
        for fault in self._faults:
            fault.fire("after_step", step)
        if stop or step == self.total_steps or step % self.config.interval == 0:
            self.save(step)

    def save(self, step: int) -> None:
        """Write a checkpoint of the run as it is after ``step``.

        A save that fails (a full disk) removes what it staged and raises a one-line
        :class:`CheckpointError` naming the cause; the complete checkpoints stay as they are.
        """
        self.wait()
        try:
            taken = self.storage.exists(step)
        except OSError as e:  # the medium cannot be read (a store away)
            raise self._save_failed(step, e) from e
        if taken:
            raise exists_error(self.storage.where(step))
        start = time.perf_counter()
        failure: OSError | None = None
        if self.dims.is_main:
            try:
                self.storage.stage(step, self.run_config, self.run_files)
            except OSError as e:
                failure = e
        # Asked of every rank rather than a barrier, so that all stop when rank 0 cannot start.
        if self._any_rank(failure is not None):
            raise self._save_failed(step, failure) from failure
        state = self._state(with_rng=True, plugins=None, optimizer_state=bool(self.optimizer.state))
        if self.left_out:
            state["base"] = {"sha256": self._base_source()[1]}
        state = self._storable(state)
        writer = self.storage.writer(step)
        if self._executor is None:
            try:
                with _interruptible():
                    dcp.save(state, storage_writer=writer)
            except (Exception, dcp.CheckpointException) as e:
                raise self._save_failed(step, e) from e
            self._commit(step, start, self._control_group)
            self.host.hook.checkpoint_saved(folder=self.storage.where(step), step=step)
            return
        try:
            with _interruptible():
                upload = dcp.async_save(
                    state, storage_writer=writer, process_group=self._async_group
                )
        except (Exception, dcp.CheckpointException) as e:
            raise self._save_failed(step, e) from e
        logger.info(
            "checkpoint step-%d copied in %.2f s, writing it in the background",
            step,
            time.perf_counter() - start,
        )
        self._pending = self._executor.submit(self._commit_when_written, upload, step, start)
        self._pending_step = step

    def _commit_when_written(self, upload: Future, step: int, start: float) -> None:
        try:
            upload.result()
        except (Exception, dcp.CheckpointException) as e:
            raise self._save_failed(step, e) from e
        self._commit(step, start, self._async_group)

    def _save_failed(self, step: int, error: BaseException | None) -> CheckpointError:
        """The one-line error for a failed save, once rank 0 has removed what it staged."""
        free = self.storage.free_bytes()
        if self.dims.is_main:
            self.storage.discard(step)
        return save_failed(
            self.storage.where(step), self.storage.location, error, free, self.storage.save_fix
        )

    def _commit(self, step: int, start: float, group: dist.ProcessGroup | None) -> None:
        """Once every rank has written its shard, make the checkpoint visible (rank 0), then
        apply the retention (``keep_latest_k``)."""
        for fault in self._faults:
            fault.fire("before_commit", step)
        self._barrier(group)
        if self.dims.is_main:
            try:
                self.storage.commit(step)
            except FileExistsError as e:  # appeared since save() looked
                raise exists_error(self.storage.where(step)) from e
            except OSError as e:  # the marker could not be written: not complete
                raise self._save_failed(step, e) from e
        # So that on every rank a returned save is a visible one.
        self._barrier(group)
        if not self.dims.is_main:
            return
        logger.info(
            "checkpoint step-%d saved in %.2f s, %.1f MiB: %s",
            step,
            time.perf_counter() - start,
            self.storage.size(step) / 2**20,
            self.storage.where(step),
        )
        if old := self.storage.prune(self.config.keep_latest_k, step):
            logger.info(
                "deleted %s (keep_latest_k %d)",
                ", ".join(f"step-{s}" for s in old),
                self.config.keep_latest_k,
            )

    def wait(self) -> None:
        """Block until an async save in flight is written and committed (re-raising its error),
        then fire ``checkpoint_saved`` for it: here, on the main thread of every rank."""
        pending, self._pending = self._pending, None
        step, self._pending_step = self._pending_step, None
        if pending is not None and step is not None:
            pending.result()
            self.host.hook.checkpoint_saved(folder=self.storage.where(step), step=step)

    def close(self) -> None:
        """Finish any save in flight (collective)."""
        try:
            self.wait()
        finally:
            self.abort()

    def abort(self) -> None:
        """After an error: abandon a save in flight without waiting for it (its collectives
        may wait for a rank that failed); it stays ``.partial``, never loaded (idempotent)."""
        self._pending = self._pending_step = None
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
        if self.dims.world_size > 1:
            dist.barrier(group=group)

    # ----------------------------------------------------------------------- the state

    def _state(
        self,
        with_rng: bool,
        plugins: set[str] | None,
        optimizer_state: bool,
        skip: set[str] | None = None,
    ) -> dict[str, Any]:
        """The run's state as nested dicts of tensors and numbers (live tensors: DCP loads
        into them). ``with_rng`` adds this rank's generators; ``plugins`` restricts the
        plugins' states to those names (None: every plugin that has state);
        ``optimizer_state`` False leaves the optimizer's per-parameter state out, for an
        optimizer that has not stepped yet (every step so far vetoed). The parameters of
        ``skip`` (by default :attr:`left_out`) are left out."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        skip = self.left_out if skip is None else skip
        model = {k: v for k, v in model.items() if k not in skip}
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
            "world": {"size": self.dims.world_size},
            "plugins": plugin_states,
        }
        if with_rng:
            state["rng"] = {f"rank{self.dims.rank}": rng_state(self.dims.device)}
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
        once the resume has succeeded. With ``checkpoint.enable`` off nothing is resumed, and
        to a run that saves its last step (``checkpoint.save_final``) every one there is later."""
        if not self.saves:
            return
        # Every rank lists them itself: the storage shows all ranks the same.
        chosen, later = choose(self.config, self.storage.steps(), self.storage.location)
        if chosen is not None:
            self._load(chosen)
        elif self.config.load_step == 0:
            logger.info("starting afresh (checkpoint.load_step 0)")
        elif self.config.enable:
            logger.info(
                "no checkpoint to resume from in %s: training from step 0", self.storage.location
            )
        if later:
            if self.dims.is_main:
                for s in later:
                    self.storage.delete(s)
                logger.info(
                    "deleted %s (checkpoint.discard_later)", ", ".join(f"step-{s}" for s in later)
                )
            self._barrier(self._control_group)

    @property
    def destination(self) -> str | None:
        """Where the run's checkpoints go (a folder or a URL, for its records); None if it
        saves none."""
        return str(self.storage.location) if self.saves else None

    def latest(self) -> Path | str | None:
        """The latest complete checkpoint of the dump folder, the run's own once it has saved
        or resumed (see :meth:`load`); None if the run saves none, or there is none yet."""
        if not self.saves:
            return None  # the folder may hold an earlier run's, which this run ignores
        found = self.storage.steps()
        return self.storage.where(found[-1]) if found else None

    def latest_at_most(self, at_most: int) -> int:
        """The step of the latest complete checkpoint at step ``at_most`` or earlier; a one-line
        :class:`CheckpointError` if there is none."""
        return latest_at_most(self.storage.steps(), at_most, self.storage.location)

    def rewind(self, at_most: int) -> int:
        """Go back to the latest complete checkpoint at step ``at_most`` or earlier, delete the
        later ones, and return its step (collective).

        The later checkpoints go only once the load has succeeded: a crash before leaves them,
        and the caller's record of the rewind (``data_skips.json``) has it done again.
        """
        self.wait()
        chosen = self.latest_at_most(at_most)
        self._load(chosen)
        if self.dims.is_main:
            for s in self.storage.steps():
                if s > chosen:
                    self.storage.delete(s)
        self._barrier(self._control_group)
        return chosen

    def _load(self, step: int) -> None:
        start = time.perf_counter()
        path = self.storage.where(step)
        saved = read_metadata(path, self.storage.reader(step)).state_dict_metadata
        in_checkpoint = {key.split(".")[1] for key in saved if key.startswith("plugins.")}
        loaders = set(self.host.implementers("load_state_dict"))
        rank_rng = f"rng.rank{self.dims.rank}."
        has_rng = any(key.startswith(rank_rng) for key in saved)
        # The frozen weights the checkpoint left out are re-read from the initial load, whether
        # this run leaves them out or not (lora.save_base may change on resume either way).
        missing = {n for n in conversion_of(self.model).frozen if f"model.{n}" not in saved}
        reread = missing if DIGEST_KEY in saved else missing & self.left_out
        template = self._state(
            with_rng=has_rng,
            plugins=in_checkpoint & loaders,
            optimizer_state=any(key.startswith("optimizer.state.") for key in saved),
            skip=reread,
        )
        if DIGEST_KEY in saved:
            template["base"] = {"sha256": torch.zeros(32, dtype=torch.uint8)}
        storable = self._storable(template)
        try:
            saved_config = self.storage.read_config(step)
        except (OSError, ValueError) as e:
            raise damaged(path, f"cannot read its {CONFIG} ({one_line(e)})") from e
        wanted = flat_keys(storable)
        if self.dims.pp_enabled:  # this rank's stages: checked against every stage's keys
            wanted = _over_stages(wanted, self.dims)
        # A plugin's setting first: one that shapes its parameters (lora.rank) is named, not
        # taken for another model.
        check_settings(path, saved_config, self.run_config, self.plugins_fixed)
        check_state(path, saved, wanted, template["plugins"])
        check_settings(path, saved_config, self.run_config)
        check_optimizer(path, saved, wanted, saved_config)
        try:
            dcp.load(
                storable, storage_reader=self.storage.reader(step), planner=TensorOnlyLoadPlanner()
            )
        except (Exception, dcp.CheckpointException) as e:
            raise damaged(path, one_line(e)) from e
        state = from_tensors(template, storable)
        if reread:
            self._reread_base(path, state, reread)
        self._apply(state, strict=not reread)
        for name, plugin_state in state["plugins"].items():
            self.host.call_one(name, "load_state_dict", state_dict=plugin_state)
        train, saved_world = state["train"], state["world"]["size"]
        self.resumed_from = {"path": str(path), "step": train["step"]}
        self.host.hook.checkpoint_loaded(folder=path, step=train["step"])
        if self.dims.is_main:
            ignored = sorted(in_checkpoint - loaders)
            if ignored:
                logger.info("checkpoint state of plugins not active in this run, ignored: %s",
                            ", ".join(ignored))  # fmt: skip
            if saved_world != self.dims.world_size:
                logger.warning(
                    "resharding checkpoint of %d ranks onto %d: model, optimizer and data "
                    "continue; random generators of ranks it did not have start afresh",
                    saved_world,
                    self.dims.world_size,
                )
        logger.info(
            "resumed from %s (step %d, %d tokens seen) in %.2f s",
            path,
            train["step"],
            train["tokens_seen"],
            time.perf_counter() - start,
        )

    def _base_source(self) -> tuple[InitialLoad, torch.Tensor]:
        """The initial load the left-out parameters come from (each rank opens it: headers
        only), and its digest, which rank 0 alone computes (a pass over the base's bytes)
        and sends to the others (collective)."""
        if self._base is None:
            source = open_initial_load(self.config)
            digest, failure = torch.empty(32, dtype=torch.uint8), None
            if self.dims.is_main:
                try:
                    digest = source_digest(source)
                except OSError as e:
                    failure = one_line(e)
            # Rank 0's failure stops every rank, none left waiting for the broadcast.
            if self._any_rank(failure is not None):
                raise CheckpointError(
                    f"cannot read checkpoint.initial_load_path '{source.path}' to hash the base "
                    f"the checkpoints leave out ({failure or 'on rank 0'}): check the folder"
                )
            if self._control_group is not None:
                dist.broadcast(digest, src=0, group=self._control_group)
            self._base = source, digest
        return self._base

    def _reread_base(self, path: Path | str, state: Mapping[str, Any], names: set[str]) -> None:
        """Put the left-out parameters ``names`` back from the initial load, once its digest
        is the one checkpoint ``path`` recorded (``state``, as loaded)."""
        if "base" not in state:
            raise CheckpointError(
                f"checkpoint {path} holds neither the frozen '{sorted(names)[0]}' nor the "
                "digest of a base to re-read it from: pick another with --checkpoint.load_step"
            )
        if not self.config.initial_load_path:
            raise CheckpointError(
                f"checkpoint {path} left the frozen '{sorted(names)[0]}' out, to be re-read "
                "from checkpoint.initial_load_path, which this run does not set: set it to the "
                "folder the run started from"
            )
        source, digest = self._base_source()
        check_digest(path, state["base"]["sha256"], source, digest)
        source.load(self.model, None, self.model.args, only=names)

    def _apply(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Put a loaded state into the model, optimizer, the other stateful pieces and RNGs."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            # Not strict where the base left out was re-read from the initial load.
            options=StateDictOptions(strict=strict),
        )
        if not state["optimizer"]["state"]:  # saved before the optimizer's first step
            self.optimizer.state.clear()
        for key, stateful in self.states.items():
            stateful.load_state_dict(state[key])
        if "rng" in state:
            set_rng_state(state["rng"][f"rank{self.dims.rank}"], self.dims.device)


def _over_stages(wanted: Mapping[str, torch.Tensor], dims: ParallelDims) -> dict[str, Any]:
    """``wanted`` (a pipeline rank's state by flattened key) with the other stages' keys of
    the same ``pp`` line, as meta tensors of their shapes: the keys a 1-process run has."""
    shapes = {key: tuple(value.shape) for key, value in wanted.items()}
    lines: list[dict[str, tuple[int, ...]] | None] = [None] * dims.pp
    dist.all_gather_object(lines, shapes, group=dims.get_mesh("pp").get_group())
    every = {key: shape for line in lines if line is not None for key, shape in line.items()}
    return {
        key: wanted[key] if key in wanted else torch.empty(shape, device="meta")
        for key, shape in every.items()
    }
