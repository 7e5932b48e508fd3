"""The run's dump folder: checked, created and locked before anything is written to it.

``job.dump_folder`` receives the metrics, run records, traces and checkpoints. Before any of
them is written, rank 0 makes sure it is a folder it can write to (one line naming the path and
the cause otherwise) and takes an exclusive ``flock`` on ``<dump_folder>/.plugtrain.lock``,
held until the trainer closes: a second run in the same folder would move the first one's
metrics aside, interleave its steps with them and prune its checkpoints. The lock file holds
the holder's pid, host and start time, for the second run's message.

The kernel drops a ``flock`` when the last descriptor of its open file is closed, which a dying
process does whatever kills it; so a lock file left by a killed run is stale by construction
and the next run simply locks it again. There is no pid to check and nothing to clean up.

A run that fails to start removes the folders it created for the dump folder if it wrote
nothing into them but the lock file, so that a failed start leaves nothing behind.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from plugtrain.distributed import ParallelDims
from plugtrain.errors import DumpFolderError

LOCK_FILE = ".plugtrain.lock"
"""The file of the dump folder that rank 0 of the run using it holds a ``flock`` on."""

_FIX = "set job.dump_folder to a folder you can write to"


@dataclass
class _Held:
    fd: int
    claims: int
    created: Path | None
    """The outermost folder the first claim created (None: the dump folder existed)."""


# Folders this process holds, by resolved path. A second open file of the same lock file
# would conflict with the first (flock is per open file, not per process), so a second
# trainer of the same process in the same folder shares the lock instead.
_HELD: dict[Path, _Held] = {}


class DumpFolderLock:
    """This process's claim on a dump folder (none on ranks other than 0)."""

    def __init__(self, key: Path | None) -> None:
        self._key = key

    def release(self, *, failed_start: bool = False) -> None:
        """Give the claim up; the folder is unlocked when the process's last claim goes.

        With ``failed_start``, the last claim also removes the folders it created if they hold
        nothing but the lock file: a run that could not start leaves no empty dump folder.
        """
        key, self._key = self._key, None
        if key is None:
            return
        held = _HELD[key]
        held.claims -= 1
        if not held.claims:
            del _HELD[key]
            if failed_start and held.created is not None:
                _remove_if_empty(key, held.created)
            os.close(held.fd)  # closing the only descriptor of the lock file drops the flock


def lock_dump_folder(path: str | os.PathLike[str], dims: ParallelDims) -> DumpFolderLock:
    """Check and create dump folder ``path`` and lock it for this run (collective).

    Rank 0 does the work; every rank raises the same one-line :class:`DumpFolderError` when
    ``path`` is not a folder, cannot be created or written, or is locked by another run.
    """
    lock, message = DumpFolderLock(None), None
    if dims.is_main:
        try:
            lock = claim_dump_folder(path)
        except DumpFolderError as e:
            message = str(e)
    if dims.world_size > 1:
        shared = [message]
        dist.broadcast_object_list(shared, src=0)
        message = shared[0]
    if message is not None:
        raise DumpFolderError(message)
    return lock


def claim_dump_folder(path: str | os.PathLike[str]) -> DumpFolderLock:
    """Rank 0's part of :func:`lock_dump_folder`: check, create and lock ``path``."""
    folder = Path(path)
    created = _create(folder)
    key = folder.resolve()
    if key in _HELD:
        _HELD[key].claims += 1
        return DumpFolderLock(key)
    _check_writable(folder)
    lock_path = folder / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DumpFolderError(
            f"cannot write to job.dump_folder {folder}: {_cause(e)}: {_FIX}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(lock_path)
        os.close(fd)
        raise DumpFolderError(
            f"job.dump_folder {folder} is in use by another run{holder}: wait for it to finish "
            "or set job.dump_folder elsewhere"
        ) from None
    about = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now().astimezone().isoformat(sep=" ", timespec="seconds"),
    }
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(about) + "\n").encode())
    except OSError as e:
        os.close(fd)
        raise DumpFolderError(
            f"cannot write to job.dump_folder {folder}: {_cause(e)}: {_FIX}"
        ) from None
    _HELD[key] = _Held(fd, 1, created and created.resolve())
    return DumpFolderLock(key)


def _create(folder: Path) -> Path | None:
    """Create ``folder`` and its missing parents; return the outermost one it created."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    if folder.exists() and not folder.is_dir():
        raise DumpFolderError(
            f"job.dump_folder {folder} is a file, not a folder: set job.dump_folder to a folder "
            "(it is created if missing)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        cause = _cause(e)
        if e.errno in (errno.ENOTDIR, errno.EEXIST):
            blocker = next((p for p in folder.parents if p.exists()), None)
            if blocker is not None and not blocker.is_dir():
                cause = f"{blocker} is a file"
        raise DumpFolderError(f"cannot create job.dump_folder {folder}: {cause}: {_FIX}") from None
    return missing[-1] if missing else None


def _remove_if_empty(folder: Path, created: Path) -> None:
    """Remove the lock file and ``folder``, then its parents up to ``created``, while empty."""
    if [p.name for p in folder.iterdir()] != [LOCK_FILE]:
        return
    (folder / LOCK_FILE).unlink()
    for path in (folder, *folder.parents):
        if not path.is_relative_to(created):
            return  # it existed before the run
        try:
            path.rmdir()
        except OSError:
            return  # not empty: something else was written into it meanwhile


def _check_writable(folder: Path) -> None:
    """Create and drop a file: permissions (root ignores them), a read-only mount, quotas."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise DumpFolderError(
            f"cannot write to job.dump_folder {folder}: {_cause(e)}: {_FIX}"
        ) from None


def _cause(e: OSError) -> str:
    return e.strerror or str(e)


def _holder(lock_path: Path) -> str:
    """`` (pid N on host H since T)`` from the lock file, or ``""`` when it says nothing yet."""
    try:
        about = json.loads(lock_path.read_text())
        return f" (pid {about['pid']} on host {about['host']} since {about['since']})"
    except (OSError, ValueError, TypeError, KeyError):
        return ""  # the holder is between locking the file and writing to it
