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
``train`` (step, tokens seen, skipped steps, world size), ``rng.rank<R>`` (each rank's torch,
CUDA, Python and NumPy generator states) and ``plugins.<name>`` (each stateful plugin's
``state_dict`` hook). Numbers are stored as 0-d tensors, so a checkpoint holds tensors only:
loading never unpickles an object (tensors go through ``torch.load(weights_only=True)``, DCP's
``.metadata`` file through an unpickler that admits DCP's own metadata classes only).

Resuming reshards: the model and optimizer may be loaded on another number of ranks, and the
data loader's position does not depend on it; only the RNG streams of ranks the checkpoint did
not have start afresh.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from plugtrain.errors import CheckpointError, one_line

if TYPE_CHECKING:
    from plugtrain.training.trainer import Trainer

logger = logging.getLogger("plugtrain")

CHECKPOINTS = "checkpoints"
"""The folder of ``job.dump_folder`` that holds a run's checkpoints."""
FAULT_ENV = "PLUGTRAIN_CHECKPOINT_FAULT"
"""Test-only crash injection: comma-separated ``<point>:<step>:<rank>[:<marker file>]``. That
rank kills itself with SIGKILL at ``point`` (``after_step``, or ``before_commit``: its shard is
written, the checkpoint not yet made visible) of that step; with a marker file, only if the file
does not exist yet (it is created first), so that a restarted run does not crash again."""

_STEP_DIR = re.compile(r"step-(\d+)")
_PARTIAL, _DELETING = ".partial", ".deleting"


# --------------------------------------------------------------------------- the folder


def checkpoint_folder(dump_folder: str | os.PathLike[str]) -> Path:
    """Where the run writing to ``dump_folder`` keeps its checkpoints."""
    return Path(dump_folder) / CHECKPOINTS


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """The complete checkpoints in ``folder`` by step, oldest first (none if it is missing)."""
    if not folder.is_dir():
        return {}
    found = {
        int(match[1]): path
        for path in folder.iterdir()
        if (match := _STEP_DIR.fullmatch(path.name)) and path.is_dir()
    }
    return dict(sorted(found.items()))


def _delete(path: Path) -> None:
    """Remove a checkpoint folder; renamed first, so a half-deleted one is never loaded."""
    doomed = path.with_name(path.name + _DELETING)
    if doomed.exists():  # left by a crash while deleting it before
        shutil.rmtree(doomed)
    path.rename(doomed)
    shutil.rmtree(doomed)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# --------------------------------------------------------------------------- safe reading


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and refuses every class but DCP's own metadata types.

    NOTE: DCP writes ``.metadata`` with ``pickle`` and its FileSystemReader reads it with a plain
    ``pickle.load``, which would run any code a crafted file names.
    """

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
            "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load '{module}.{name}' from .metadata")


class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` whose ``.metadata`` unpickling admits DCP's types only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, minus ``load_bytes``: that one runs ``torch.load(weights_only=False)``
    on non-tensor entries. Our checkpoints have none, so meeting one means a foreign file."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint entry '{read_item.dest_index.fqn}' is a pickled object, which plugtrain "
            "never loads: use a checkpoint written by plugtrain"
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint folder ``path``, or a one-line :class:`CheckpointError`."""
    try:
        return SafeFileSystemReader(path).read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: it has no .metadata; delete it to resume from the "
            "one before, or pick one with --checkpoint.load_step"
        ) from e
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: cannot read its .metadata ({one_line(e)}); delete "
            "it to resume from the one before, or pick one with --checkpoint.load_step"
        ) from e


def read_checkpoint(path: str | os.PathLike[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint folder ``path`` whose key starts with ``prefix``, as full
    tensors by flattened key (``model.layers.0.attention.wq.weight``), read in this process
    alone: to inspect or export a checkpoint, or to compare two."""
    path = Path(path)
    metadata = read_metadata(path)
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        # NOTE: DCP warns that it assumes one process when torch.distributed is not set up,
        # which is exactly what no_dist asks for.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path),
            planner=_TensorOnlyLoadPlanner(),
            no_dist=True,
        )
    return state


# --------------------------------------------------------------------------- numbers as tensors


def to_tensors(tree: Any, key: str = "") -> Any:
    """``tree`` (nested dicts, lists, tensors and numbers) as nested dicts of tensors only.

    Numbers become 0-d tensors (int64, float64: exact for any Python int or float that fits,
    bool), lists and tuples dicts keyed by index, and ``None`` is left out; anything else is an
    error naming ``key``. :func:`from_tensors` turns the result back, given the original.
    """
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, bool):
        return torch.tensor(tree)
    if isinstance(tree, int):
        return torch.tensor(tree, dtype=torch.int64)
    if isinstance(tree, float):
        return torch.tensor(tree, dtype=torch.float64)
    if isinstance(tree, Mapping):
        items: Iterator[tuple[Any, Any]] = iter(tree.items())
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        raise CheckpointError(
            f"cannot checkpoint '{key}': it is a {type(tree).__name__}, and checkpoints hold "
            "only tensors and numbers (in dicts and lists)"
        )
    return {
        str(k): to_tensors(v, f"{key}.{k}" if key else str(k)) for k, v in items if v is not None
    }


def from_tensors(template: Any, loaded: Any) -> Any:
    """Undo :func:`to_tensors`: ``template`` with each value replaced by its loaded tensor,
    converted back to the template's type. Values ``to_tensors`` left out (``None``) or that
    were not stored keep the template's."""
    if isinstance(template, torch.Tensor):
        return loaded
    if isinstance(template, bool | int | float):
        return type(template)(loaded.item())
    if isinstance(template, Mapping):
        return {
            k: from_tensors(v, loaded[str(k)]) if str(k) in loaded else v
            for k, v in template.items()
        }
    if isinstance(template, list | tuple):
        return type(template)(
            from_tensors(v, loaded[str(i)]) if str(i) in loaded else v
            for i, v in enumerate(template)
        )
    return template


def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of nested dicts ``tree`` by DCP's flattened key (``a.b.c``)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --------------------------------------------------------------------------- RNG states


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators (torch CPU and CUDA, Python, NumPy) as tensors."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "words": torch.tensor(words, dtype=torch.int64),
            "has_gauss": gauss is not None,
            "gauss": gauss or 0.0,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached_gaussian),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (after :func:`from_tensors`)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate(
        (py["version"], tuple(py["words"].tolist()), py["gauss"] if py["has_gauss"] else None)
    )
    npy = state["numpy"]
    np.random.set_state(
        ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
         npy["gauss"])
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# --------------------------------------------------------------------------- fault injection


@dataclass(frozen=True)
class _Fault:
    """One crash that :data:`FAULT_ENV` asks this rank to simulate (tests only)."""

    point: str
    step: int
    marker: Path | None

    @staticmethod
    def from_env(rank: int) -> list[_Fault]:
        faults = []
        for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
            point, step, fault_rank, *marker = spec.split(":", 3)
            if point not in ("after_step", "before_commit"):
                raise ValueError(f"{FAULT_ENV}: unknown point {point!r}")
            if int(fault_rank) == rank:
                faults.append(_Fault(point, int(step), Path(marker[0]) if marker else None))
        return faults

    def fire(self, point: str, step: int) -> None:
        if (point, step) != (self.point, self.step):
            return
        if self.marker is not None:
            if self.marker.exists():
                return
            self.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Restores a run at start-up and saves it on schedule, on SIGTERM and at the end.

    The trainer calls :meth:`load` once, after plugin setup; :meth:`after_step` after every
    optimizer step (it saves when due and says whether to stop); :meth:`close` at the end. With
    ``checkpoint.enable`` off, each is a no-op. Every method is collective: all ranks call it.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.config = trainer.config.checkpoint
        self.folder = checkpoint_folder(trainer.config.job.dump_folder)
        self.world = trainer.world
        self._stop_requested = False
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._control_group: dist.ProcessGroup | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._previous_sigterm: Callable | int | None = None
        self._sigterm_installed = False
        self._faults = _Fault.from_env(self.world.rank)
        if not self.config.enable:
            return
        if self.world.world_size > 1:
            # NOTE: a CPU (gloo) group for the per-step stop vote and the save barriers, whatever
            # the training backend: a few bytes over TCP, no device synchronisation.
            self._control_group = dist.new_group(backend="gloo")
        if self.config.async_mode == "async":
            # NOTE: the background save runs DCP's collectives; on a group of their own they
            # never interleave with the training loop's.
            self._async_group = dist.new_group(backend="gloo")
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="plugtrain-checkpoint")

    def _on_sigterm(self, signum: int, frame: object) -> None:
        # NOTE: only a flag: the step in progress finishes, then after_step saves and stops.
        self._stop_requested = True

    # ----------------------------------------------------------------------- saving

    def after_step(self) -> bool:
        """Save if the step just taken is due (every ``checkpoint.interval`` steps, the last
        step, or any rank got SIGTERM); return True when the run must stop (SIGTERM)."""
        if not self.config.enable:
            return False
        step = self.trainer.step
        for fault in self._faults:
            fault.fire("after_step", step)
        stop = self._vote(self._stop_requested)
        last = step == self.trainer.config.training.steps
        if stop or last or step % self.config.interval == 0:
            self.save()
        if stop and not last:
            logger.info("stopped after step %d on SIGTERM; run the same command to resume", step)
        return stop

    def save(self) -> None:
        """Write a checkpoint of the trainer's current step."""
        self.wait()
        step = self.trainer.step
        final = self.folder / f"step-{step}"
        partial = final.with_name(final.name + _PARTIAL)
        start = time.perf_counter()
        if self.world.is_main:
            if partial.exists():  # left by a crash while saving this very step
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        self._barrier(self._control_group)
        state = self._storable(
            self._state(
                with_rng=True, plugins=None, optimizer_state=bool(self.trainer.optimizer.state)
            )
        )
        writer = FileSystemWriter(partial)
        if self._executor is None:
            dcp.save(state, storage_writer=writer)
            self._commit(step, partial, final, start, self._control_group)
            return
        upload = dcp.async_save(state, storage_writer=writer, process_group=self._async_group)
        logger.info(
            "checkpoint step-%d copied in %.2f s, writing it in the background",
            step,
            time.perf_counter() - start,
        )
        self._pending = self._executor.submit(
            self._commit_when_written, upload, step, partial, final, start
        )

    def _commit_when_written(
        self, upload: Future, step: int, partial: Path, final: Path, start: float
    ) -> None:
        upload.result()
        self._commit(step, partial, final, start, self._async_group)

    def _commit(
        self, step: int, partial: Path, final: Path, start: float, group: dist.ProcessGroup | None
    ) -> None:
        """Once every rank has written its shard, make the checkpoint visible (rank 0)."""
        for fault in self._faults:
            fault.fire("before_commit", step)
        self._barrier(group)
        if self.world.is_main:
            if final.exists():  # an earlier save of this step, by a run resumed from before it
                _delete(final)
            partial.rename(final)
        # NOTE: so that on every rank a returned save is a visible one.
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

    def _prune(self, step: int) -> None:
        """Delete what a crash left behind, checkpoints after ``step`` (a run resumed from an
        earlier one abandoned them) and all but the newest ``keep_latest_k``."""
        for path in self.folder.iterdir():
            if path.name.endswith((_PARTIAL, _DELETING)):
                shutil.rmtree(path)
        steps = list(complete_checkpoints(self.folder))
        abandoned = [s for s in steps if s > step]
        keep = self.config.keep_latest_k
        old = [s for s in steps if s <= step][:-keep] if keep else []
        for s in abandoned + old:
            _delete(self.folder / f"step-{s}")
        if abandoned:
            logger.info(
                "deleted %s: saved by the run this one resumed from an earlier checkpoint",
                ", ".join(f"step-{s}" for s in abandoned),
            )
        if old:
            logger.info(
                "deleted %s (keep_latest_k %d)",
                ", ".join(f"step-{s}" for s in old),
                self.config.keep_latest_k,
            )

    def wait(self) -> None:
        """Block until an async save in flight is written and committed (re-raising its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish any save in flight and give the SIGTERM handler back."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None
            if self._sigterm_installed:
                # NOTE: signal.signal returns None for a handler not set from Python.
                previous = self._previous_sigterm
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
                self._sigterm_installed = False

    def _vote(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (SIGTERM may reach only some)."""
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
        """The trainer's state as nested dicts of tensors and numbers (live tensors: DCP loads
        into them). ``with_rng`` adds this rank's generators; ``plugins`` restricts the
        plugins' states to those names (None: every plugin that has state);
        ``optimizer_state`` False leaves the optimizer's per-parameter state out, for an
        optimizer that has not stepped yet (every step so far vetoed)."""
        t = self.trainer
        model, optimizer = get_state_dict(t.model, t.optimizer)
        if not optimizer_state:
            # NOTE: get_state_dict gives an optimizer that has not stepped a state by taking a
            # zero-lr step; the run must go on as if it had not (AdamW counts its steps).
            t.optimizer.state.clear()
            optimizer = {**optimizer, "state": {}}
        plugin_states = t.plugins.call_each("state_dict")
        if plugins is not None:
            plugin_states = {k: v for k, v in plugin_states.items() if k in plugins}
        state = {
            "model": model,
            "optimizer": optimizer,
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "data": t.loader.state_dict(),
            "train": {
                "step": t.step,
                "tokens_seen": t.tokens_seen,
                "skipped_steps": t.skipped_steps,
                "world_size": self.world.world_size,
            },
            "plugins": plugin_states,
        }
        if with_rng:
            state["rng"] = {f"rank{self.world.rank}": rng_state(self.world.device)}
        return state

    @staticmethod
    def _storable(state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as tensors only (:func:`to_tensors`).

        NOTE: an optimizer param group's ``params`` are parameter names, which the model that
        loads the checkpoint supplies: they are left out rather than pickled.
        """
        optimizer = state["optimizer"]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        return to_tensors({**state, "optimizer": {**optimizer, "param_groups": groups}})

    # ----------------------------------------------------------------------- loading

    def load(self) -> None:
        """Resume from the checkpoint ``checkpoint.load_step`` picks, if any. From then on a
        SIGTERM makes the run save and stop at the end of the current step."""
        if not self.config.enable:
            return
        chosen = self._choose()
        if chosen is None:
            logger.info("no checkpoint to resume from in %s: training from step 0", self.folder)
        else:
            self._load(chosen)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True

    def _choose(self) -> Path | None:
        # NOTE: every rank lists the folder itself: DCP's file system storage already needs
        # one folder that all ranks see.
        available = complete_checkpoints(self.folder)
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
            return available[load_step]
        return available[max(available)] if available else None

    def _load(self, path: Path) -> None:
        start = time.perf_counter()
        metadata = read_metadata(path)
        saved = metadata.state_dict_metadata
        in_checkpoint = {key.split(".")[1] for key in saved if key.startswith("plugins.")}
        loaders = {
            impl.plugin_name: impl
            for impl in self.trainer.plugins.hook.load_state_dict.get_hookimpls()
        }
        rank_rng = f"rng.rank{self.world.rank}."
        has_rng = any(key.startswith(rank_rng) for key in saved)
        template = self._state(
            with_rng=has_rng,
            plugins=in_checkpoint & set(loaders),
            optimizer_state=any(key.startswith("optimizer.state.") for key in saved),
        )
        storable = self._storable(template)
        self._check(path, saved, flat_keys(storable), template["plugins"])
        try:
            dcp.load(
                storable,
                storage_reader=SafeFileSystemReader(path),
                planner=_TensorOnlyLoadPlanner(),
            )
        except (Exception, dcp.CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {one_line(e)}; delete it to resume from the one "
                "before, or pick one with --checkpoint.load_step"
            ) from e
        state = from_tensors(template, storable)
        self._apply(state)
        for name, plugin_state in state["plugins"].items():
            impl = loaders[name]  # NOTE: an implementation may take no argument at all
            impl.function(**{arg: plugin_state for arg in impl.argnames})
        train = state["train"]
        if self.world.is_main:
            ignored = sorted(in_checkpoint - set(loaders))
            if ignored:
                logger.info("checkpoint state of plugins not active in this run, ignored: %s",
                            ", ".join(ignored))  # fmt: skip
            if train["world_size"] != self.world.world_size:
                logger.warning(
                    "resharding checkpoint of %d ranks onto %d: model, optimizer and data "
                    "continue; random generators of ranks it did not have start afresh",
                    train["world_size"],
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

    def _apply(self, state: Mapping[str, Any]) -> None:
        """Put a loaded state into the trainer, its optimizer, schedule, loader and RNGs."""
        t = self.trainer
        set_state_dict(
            t.model,
            t.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        if not state["optimizer"]["state"]:  # saved before the optimizer's first step
            t.optimizer.state.clear()
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])
        t.loader.load_state_dict(state["data"])
        train = state["train"]
        t.step, t.tokens_seen, t.skipped_steps = (
            train["step"],
            train["tokens_seen"],
            train["skipped_steps"],
        )
        if "rng" in state:
            set_rng_state(state["rng"][f"rank{self.world.rank}"], self.world.device)
