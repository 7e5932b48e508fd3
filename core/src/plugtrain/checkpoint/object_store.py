"""Checkpoints on object storage: :class:`FsspecStorage` at an fsspec URL, and :func:`open_storage`.

A ``job.dump_folder`` such as ``s3://bucket/prefix`` keeps its checkpoints under
``s3://bucket/prefix/checkpoints/step-<N>/`` (other fsspec schemes go through the same code;
``s3`` needs the ``plugtrain[s3]`` extra). An object store has no atomic rename, so a checkpoint
is written where it stays and committed by a marker object, :data:`MARKER`, written last, once
every rank's shard and DCP's ``.metadata`` are up::

    step-200/.committed   complete: the only steps listed
    step-300/             no marker: being written, or left by a crash; removed by ``clean``

Deleting removes the marker first, so a crash halfway leaves an unmarked prefix, never a
half-deleted listed one. Each object is spooled to a local temporary file (``TMPDIR``), then
uploaded with bounded retries and exponential backoff (``checkpoint.store_retries``); the last
failure is an ``OSError`` naming the object, which the manager turns into one line.

Credentials come from the standard AWS chain (environment, ``~/.aws`` files, instance roles):
plugtrain never takes, prints or stores a secret. ``checkpoint.endpoint_url`` (or botocore's
own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) points at an S3-compatible store.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Generator, Mapping
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem,
    FsspecReader,
    FsspecWriter,
)

from plugtrain.checkpoint.dcp_io import SafeMetadata
from plugtrain.checkpoint.layout import CHECKPOINTS, CONFIG, STEP_DIR, checkpoint_folder
from plugtrain.checkpoint.storage import CheckpointStorage, LocalStorage
from plugtrain.errors import CheckpointError, one_line
from plugtrain.urls import check_url, is_url

__all__ = ["MARKER", "FsspecStorage", "SafeFsspecReader", "open_checkpoints", "open_storage"]

logger = logging.getLogger("plugtrain")

MARKER = ".committed"
"""The object of a checkpoint prefix written last: the checkpoint is complete once it exists."""

T = TypeVar("T")


def _retrying(what: str, attempts: int, backoff_s: float, call: Callable[[], T]) -> T:
    """``call()``, tried ``attempts`` times, waiting ``backoff_s``, then twice as long, between
    tries; the last failure is an ``OSError`` naming ``what`` (``FileNotFoundError`` at once for
    an absent object)."""
    for attempt in range(attempts):
        try:
            return call()
        except FileNotFoundError as e:  # an absent object stays absent: no retry
            raise FileNotFoundError(errno.ENOENT, f"{what} failed: no such object") from e
        except Exception as e:  # the store's errors come as many types (botocore, aiohttp)
            if attempt == attempts - 1:
                why = f"{what} failed {attempts} times, last: {one_line(e)}"
                raise OSError(errno.EIO, why) from e
            wait = backoff_s * 2**attempt
            logger.warning("%s failed (%s), trying again in %.1f s", what, one_line(e), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


class _UploadingFileSystem(FileSystem):
    """DCP's fsspec file system for writing: each object goes to a local spool, then up, and
    each request is retried with backoff: an object store's failure mid-save costs a retry of
    that request, not of the whole save."""

    def __init__(self, fs: Any, attempts: int, backoff_s: float) -> None:
        super().__init__()
        self.fs, self.attempts, self.backoff_s = fs, attempts, backoff_s

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str | os.PathLike[str]:
        return path

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if not any(ch in mode for ch in "wa+"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        # DCP may close the stream itself: the spool is a named file, uploaded once it is.
        fd, spool = tempfile.mkstemp(prefix="plugtrain-upload-")
        try:
            with os.fdopen(fd, "wb") as stream:
                yield stream
            _retrying(
                f"upload of {self.url(path)}",
                self.attempts,
                self.backoff_s,
                lambda: self.fs.put_file(spool, os.fspath(path)),
            )
        finally:
            os.unlink(spool)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing: an object store has no folders (s3fs would try to create a bucket)."""

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # DCP writes .metadata.tmp, then renames it: a copy on an object store, and before the
        # marker, so never a committed checkpoint's.
        _retrying(
            f"copy to {self.url(new_path)}",
            self.attempts,
            self.backoff_s,
            lambda: self.fs.mv(os.fspath(path), os.fspath(new_path)),
        )

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return _retrying(
            f"lookup of {self.url(path)}",
            self.attempts,
            self.backoff_s,
            lambda: bool(self.fs.exists(os.fspath(path))),
        )

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        _retrying(
            f"removal of {self.url(path)}",
            self.attempts,
            self.backoff_s,
            lambda: self.fs.rm_file(os.fspath(path)),
        )

    def url(self, path: str | os.PathLike[str]) -> str:
        return self.fs.unstrip_protocol(os.fspath(path))


class _Writer(FsspecWriter):
    """DCP's fsspec writer through :class:`_UploadingFileSystem` (no fsync: an upload is
    durable once it returns)."""

    def __init__(self, path: str, fs: Any, attempts: int, backoff_s: float) -> None:
        super().__init__(path, sync_files=False)
        self.fs = _UploadingFileSystem(fs, attempts, backoff_s)


class SafeFsspecReader(SafeMetadata, FsspecReader):
    """A DCP ``FsspecReader`` whose ``.metadata`` unpickling admits DCP's types only."""


class FsspecStorage(CheckpointStorage):
    """Checkpoints as ``step-<N>/`` prefixes under ``<url>/checkpoints``, each complete once its
    :data:`MARKER` exists (see the module)."""

    save_fix = (
        "once the store answers again, run the same command: it resumes from the latest "
        "(raise checkpoint.store_retries to ride out longer outages)"
    )

    def __init__(
        self,
        url: str,
        endpoint_url: str = "",
        attempts: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        import fsspec

        self.url = url.rstrip("/")
        options: dict[str, Any] = {}
        if urlsplit(self.url).scheme in ("s3", "s3a"):
            # botocore retries nothing itself: the attempts here are all there are.
            options["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 10}
            # Another rank writes and deletes here: a cached listing would hide its objects.
            options["use_listings_cache"] = False
            if endpoint_url:
                options["endpoint_url"] = endpoint_url
            # fsspec caches instances by their arguments, not by the environment they read
            # (AWS_ENDPOINT_URL, the credentials): a cached one would reach an old endpoint.
            options["skip_instance_cache"] = True
        self.fs, root = fsspec.url_to_fs(self.url, **options)
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own retry loop, replaced by ours
        self.root = f"{root.rstrip('/')}/{CHECKPOINTS}"
        self.attempts, self.backoff_s = attempts, backoff_s

    @property
    def location(self) -> str:
        return f"{self.url}/{CHECKPOINTS}"

    def where(self, step: int) -> str:
        return f"{self.location}/step-{step}"

    def _prefix(self, step: int) -> str:
        return f"{self.root}/step-{step}"

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        return _retrying(what, self.attempts, self.backoff_s, call)

    def check(self) -> None:
        """Refuse, in one line naming the URL, a store that cannot be reached or listed."""
        try:
            self.fs.invalidate_cache()
            self.fs.ls(self.root.split("/", 1)[0], detail=False)
        except Exception as e:
            raise CheckpointError(
                f"cannot reach the checkpoint store {self.location}: {one_line(e)}; check "
                "job.dump_folder, checkpoint.endpoint_url (or AWS_ENDPOINT_URL) and the AWS "
                "credentials"
            ) from e

    def _prefixes(self) -> dict[int, bool]:
        """Every ``step-<N>`` prefix by step, and whether it holds the marker."""
        self.fs.invalidate_cache(self.root)
        try:
            names = self.fs.find(self.root, withdirs=False, detail=False)
        except FileNotFoundError:
            return {}
        found: dict[int, bool] = {}
        for name in names:
            step_dir, _, leaf = name[len(self.root) + 1 :].partition("/")
            if match := STEP_DIR.fullmatch(step_dir):
                step = int(match[1])
                found[step] = found.get(step, False) or leaf == MARKER
        return found

    def steps(self) -> list[int]:
        found = self._retry(f"listing of {self.location}", self._prefixes)
        return sorted(s for s, marked in found.items() if marked)

    def exists(self, step: int) -> bool:
        marker = f"{self._prefix(step)}/{MARKER}"
        self.fs.invalidate_cache(self._prefix(step))
        return self._retry(f"lookup of {self.where(step)}", lambda: bool(self.fs.exists(marker)))

    def stage(
        self, step: int, run_config: Mapping[str, Any], files: Mapping[str, bytes] | None = None
    ) -> None:
        self._remove(step)  # what a crash left while saving this very step
        config = (json.dumps(run_config, indent=2) + "\n").encode()
        for name, data in {CONFIG: config, **(files or {})}.items():
            self._retry(
                f"upload of {self.where(step)}/{name}",
                partial(self.fs.pipe_file, f"{self._prefix(step)}/{name}", data),
            )

    def writer(self, step: int) -> StorageWriter:
        return _Writer(self._prefix(step), self.fs, self.attempts, self.backoff_s)

    def commit(self, step: int) -> None:
        if self.exists(step):  # appeared since the save began: another run writes here too
            raise FileExistsError(f"{self.where(step)} is already complete")
        self._retry(
            f"upload of {self.where(step)}/{MARKER}",
            lambda: self.fs.pipe_file(f"{self._prefix(step)}/{MARKER}", b""),
        )

    def discard(self, step: int) -> None:
        with contextlib.suppress(Exception):
            self._remove(step)

    def _remove(self, step: int) -> None:
        prefix = self._prefix(step)
        self.fs.invalidate_cache(prefix)
        if self.fs.exists(prefix):
            self._retry(f"removal of {self.where(step)}", lambda: self.fs.rm(prefix, True))

    def reader(self, step: int) -> StorageReader:
        reader = SafeFsspecReader(self._prefix(step))
        reader.fs.fs = self.fs
        return reader

    def read_file(self, step: int, name: str) -> bytes:
        path = f"{self._prefix(step)}/{name}"
        return self._retry(f"download of {self.where(step)}/{name}", lambda: self.fs.cat_file(path))

    def size(self, step: int) -> int:
        prefix = self._prefix(step)
        return int(self._retry(f"listing of {prefix}", lambda: self.fs.du(prefix)))

    def free_bytes(self) -> int | None:
        return None

    def delete(self, step: int) -> None:
        self._retry(
            f"removal of {self.where(step)}/{MARKER}",
            lambda: self.fs.rm_file(f"{self._prefix(step)}/{MARKER}"),
        )
        self._remove(step)

    def clean(self) -> None:
        for step, marked in self._retry(f"listing of {self.location}", self._prefixes).items():
            if not marked:
                self._remove(step)


def open_storage(
    dump_folder: str | os.PathLike[str], endpoint_url: str = "", retries: int = 3
) -> CheckpointStorage:
    """The checkpoint store of the run writing to ``dump_folder``: its ``checkpoints`` folder,
    or for a URL (``s3://bucket/prefix``) an object store prefix (``endpoint_url`` and
    ``retries``: ``checkpoint.endpoint_url``, ``checkpoint.store_retries``)."""
    if is_url(dump_folder):
        return FsspecStorage(os.fspath(dump_folder), endpoint_url, attempts=retries + 1)
    return LocalStorage(checkpoint_folder(dump_folder))


def open_checkpoints(folder: str | os.PathLike[str], endpoint_url: str = "") -> CheckpointStorage:
    """The checkpoint store whose ``step-<N>`` checkpoints are in ``folder`` itself: a local
    folder, or a run's ``.../checkpoints`` prefix at a URL (checked, and the store reached,
    here: a one-line error naming the URL)."""
    if not is_url(folder):
        return LocalStorage(folder)
    url = os.fspath(folder).rstrip("/")
    check_url(url, "checkpoint")
    if not url.endswith(f"/{CHECKPOINTS}"):
        raise CheckpointError(
            f"'{url}' is no run's {CHECKPOINTS} prefix: give a run's dump folder URL or one "
            f"complete .../{CHECKPOINTS}/step-N prefix"
        )
    storage = FsspecStorage(url.removesuffix(f"/{CHECKPOINTS}"), endpoint_url)
    storage.check()
    return storage
