"""The checkpoint store: where checkpoints are staged, committed, listed, pruned and deleted.

:class:`CheckpointStorage` is all the :class:`~plugtrain.checkpoint.manager.CheckpointManager`
asks of the medium, DCP's writer and reader included; :class:`LocalStorage`, a folder that every
rank sees, is the implementation a run uses. Another medium (an object store through DCP's
fsspec writer and reader) is another subclass, and the manager does not change.

What an implementation must guarantee (the manager's crash safety rests on it):

- **Atomic commit.** A step's checkpoint is listed by :meth:`~CheckpointStorage.steps` (and read)
  only once :meth:`~CheckpointStorage.commit` has returned, and then whole. A crash at any moment
  before leaves that step unlisted and every other checkpoint as it was; what it staged is never
  listed, and :meth:`~CheckpointStorage.clean` removes it.
- **No replacement.** ``commit`` raises ``FileExistsError`` when the step's name is taken (a
  complete checkpoint of another run writing to the same place), and changes nothing then.
- **Unlisted before deleted.** :meth:`~CheckpointStorage.delete` takes a checkpoint off the
  listing before it removes its data, so a crash halfway leaves nothing half-deleted listed.
- **Listing.** ``steps`` lists the complete checkpoints only, oldest (lowest step) first, and
  every rank sees the same: once ``commit`` or ``delete`` has returned on rank 0, a barrier
  later every rank lists the change.
- **Safe reading.** :meth:`~CheckpointStorage.reader` gives a DCP reader that unpickles DCP's
  metadata classes only (``dcp_io.SafeMetadata``), whatever the medium, and
  :meth:`~CheckpointStorage.read_file` a checkpoint's other files: what readers of finished
  checkpoints (``checkpoint.saved``) use, so they never branch on the medium.
- **Errors.** A medium's failures are ``OSError`` (``ValueError`` for an unreadable run config):
  the manager turns them into one-line errors naming :meth:`~CheckpointStorage.where`.

Who calls what: rank 0 alone stages, commits, discards, prunes and deletes; every rank lists,
writes its own shard through :meth:`~CheckpointStorage.writer` and reads through ``reader``.

:class:`LocalStorage` keeps them in ``<job.dump_folder>/checkpoints/``::

    step-200/            complete checkpoints, the only ones listed
    step-300.partial/    being written (or left by a crash): never listed, removed later
    step-100.deleting/   being deleted: never listed

Its commit is the rename of ``step-<N>.partial/`` to ``step-<N>/``, atomic on a POSIX file
system. A store without an atomic rename commits by writing a marker object last, and lists
only the steps that have one: :class:`~plugtrain.checkpoint.object_store.FsspecStorage`, which
:func:`~plugtrain.checkpoint.object_store.open_storage` picks for a URL.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter, StorageReader, StorageWriter

from plugtrain.checkpoint.dcp_io import SafeFileSystemReader
from plugtrain.checkpoint.layout import CONFIG, complete_checkpoints

__all__ = ["DELETING", "PARTIAL", "CheckpointStorage", "LocalStorage"]

PARTIAL = ".partial"
"""The suffix of a :class:`LocalStorage` folder being written, or left by a crash."""
DELETING = ".deleting"
"""The suffix of a :class:`LocalStorage` folder being deleted."""


class CheckpointStorage(ABC):
    """Where a run's checkpoints live, one per step, and everything that touches them there."""

    save_fix = "free space or set job.dump_folder elsewhere"
    """What to do about a failed save, for its one-line error."""

    @property
    @abstractmethod
    def location(self) -> Path | str:
        """Where the checkpoints are, for messages (a folder, a URL)."""

    @abstractmethod
    def where(self, step: int) -> Path | str:
        """Where the checkpoint of ``step`` is once committed, for messages and hooks."""

    @abstractmethod
    def check(self) -> None:
        """Refuse, with a one-line ``CheckpointError``, a medium that cannot be reached (at
        start-up, on every rank)."""

    @abstractmethod
    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first (none if there is nothing)."""

    @abstractmethod
    def exists(self, step: int) -> bool:
        """Whether the name of ``step``'s checkpoint is taken (by a complete one, or else)."""

    @abstractmethod
    def stage(
        self, step: int, run_config: Mapping[str, Any], files: Mapping[str, bytes] | None = None
    ) -> None:
        """Begin the checkpoint of ``step`` (rank 0): a fresh staging area, replacing one an
        earlier attempt left, that holds the run's resolved config (:data:`CONFIG`) and
        ``files`` (its other records, by name: the chat template)."""

    @abstractmethod
    def writer(self, step: int) -> StorageWriter:
        """The DCP writer of every rank's shard of ``step``, into its staging area."""

    @abstractmethod
    def commit(self, step: int) -> None:
        """Make the staged checkpoint of ``step`` complete, atomically (rank 0, once every rank
        has written); ``FileExistsError`` if its name is taken."""

    @abstractmethod
    def discard(self, step: int) -> None:
        """Remove what the staging of ``step`` wrote (rank 0, after a failed save); never
        raises."""

    @abstractmethod
    def reader(self, step: int) -> StorageReader:
        """A safe DCP reader of the complete checkpoint of ``step``."""

    @abstractmethod
    def read_file(self, step: int, name: str) -> bytes:
        """The bytes of file ``name`` of the complete checkpoint of ``step`` (its
        :data:`CONFIG`): the one way to read a checkpoint's files, whatever the medium;
        ``FileNotFoundError``, at once, if it has none of that name."""

    def read_config(self, step: int) -> dict[str, Any]:
        """The run config saved with the complete checkpoint of ``step``."""
        return json.loads(self.read_file(step, CONFIG))

    @abstractmethod
    def size(self, step: int) -> int:
        """The bytes the complete checkpoint of ``step`` takes."""

    @abstractmethod
    def free_bytes(self) -> int | None:
        """The bytes left for checkpoints (None if unknown), to name a full medium."""

    @abstractmethod
    def delete(self, step: int) -> None:
        """Delete the complete checkpoint of ``step`` (rank 0), unlisting it first."""

    @abstractmethod
    def clean(self) -> None:
        """Remove what crashes left (rank 0): staged checkpoints, half-deleted ones."""

    def prune(self, keep: int, up_to: int) -> list[int]:
        """Retention, after a commit (rank 0): :meth:`clean`, then delete all but the newest
        ``keep`` (0: none) complete checkpoints of ``up_to`` or before, and return their steps.
        A later one is never deleted here (start-up refuses them)."""
        self.clean()
        steps = [s for s in self.steps() if s <= up_to]
        old = steps[:-keep] if keep else []
        for s in old:
            self.delete(s)
        return old


class LocalStorage(CheckpointStorage):
    """Checkpoints as ``step-<N>/`` folders of ``folder`` (see the module), which every rank
    sees: DCP's file system writer and reader already need that."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    @property
    def location(self) -> Path:
        return self.folder

    def where(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def _staging(self, step: int) -> Path:
        return self.folder / f"step-{step}{PARTIAL}"

    def check(self) -> None:
        """Nothing: the dump folder's lock has checked that the folder can be written."""

    def steps(self) -> list[int]:
        return list(complete_checkpoints(self.folder))

    def exists(self, step: int) -> bool:
        return self.where(step).exists()

    def stage(
        self, step: int, run_config: Mapping[str, Any], files: Mapping[str, bytes] | None = None
    ) -> None:
        staging = self._staging(step)
        if staging.exists():  # left by a crash while saving this very step
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        (staging / CONFIG).write_text(json.dumps(run_config, indent=2) + "\n")
        for name, data in (files or {}).items():
            (staging / name).write_bytes(data)

    def writer(self, step: int) -> StorageWriter:
        return FileSystemWriter(self._staging(step))

    def commit(self, step: int) -> None:
        final = self.where(step)
        if final.exists():  # appeared since the save began: another run writes here too
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(final))
        self._staging(step).rename(final)

    def discard(self, step: int) -> None:
        shutil.rmtree(self._staging(step), ignore_errors=True)

    def reader(self, step: int) -> StorageReader:
        return SafeFileSystemReader(self.where(step))

    def read_file(self, step: int, name: str) -> bytes:
        return (self.where(step) / name).read_bytes()

    def size(self, step: int) -> int:
        return sum(f.stat().st_size for f in self.where(step).iterdir() if f.is_file())

    def free_bytes(self) -> int | None:
        # Of the nearest existing folder: the checkpoints' own may not exist yet.
        existing = next((p for p in (self.folder, *self.folder.parents) if p.exists()), self.folder)
        try:
            return shutil.disk_usage(existing).free
        except OSError:
            return None

    def delete(self, step: int) -> None:
        path = self.where(step)
        doomed = path.with_name(path.name + DELETING)
        if doomed.exists():  # left by a crash while deleting it before
            shutil.rmtree(doomed)
        path.rename(doomed)
        shutil.rmtree(doomed)

    def clean(self) -> None:
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            if path.name.endswith((PARTIAL, DELETING)):
                shutil.rmtree(path)
