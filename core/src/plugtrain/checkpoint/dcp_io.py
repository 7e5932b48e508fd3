"""Reading DCP checkpoints safely, and the tensor trees that checkpoints are made of.

DCP writes ``.metadata`` with ``pickle``, and its ``FileSystemReader`` would unpickle anything a
crafted file names; :class:`SafeMetadata` (on any file system reader of DCP, local or fsspec's:
:class:`SafeFileSystemReader` is the local one) admits DCP's own metadata classes only, and
:class:`TensorOnlyLoadPlanner` refuses non-tensor entries. Checkpoints hold tensors only:
:func:`to_tensors` turns numbers into 0-d tensors and :func:`from_tensors` turns them back.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from plugtrain.errors import CheckpointError, one_line


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and refuses every class but DCP's own metadata types.

    DCP writes ``.metadata`` with ``pickle`` and its FileSystemReader reads it with a plain
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


class SafeMetadata:
    """Mixin for a DCP ``FileSystemReader`` (or a subclass, such as ``FsspecReader``) whose
    ``.metadata`` unpickling admits DCP's types only; it reads through the reader's ``fs``,
    so the data may be on any medium that reader knows."""

    fs: Any
    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(SafeMetadata, FileSystemReader):
    """A DCP ``FileSystemReader`` (a local folder) whose ``.metadata`` unpickling admits DCP's
    types only."""


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, minus ``load_bytes``: that one runs ``torch.load(weights_only=False)``
    on non-tensor entries. Our checkpoints have none, so meeting one means a foreign file."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint entry '{read_item.dest_index.fqn}' is a pickled object, which plugtrain "
            "never loads: use a checkpoint written by plugtrain"
        )


def damaged(path: str | os.PathLike[str], why: str) -> CheckpointError:
    """The one-line error for checkpoint ``path`` that cannot be read (``why``), and the way out."""
    return CheckpointError(
        f"checkpoint {path} is damaged: {why}; delete it to resume from the one before, or pick "
        "one with --checkpoint.load_step"
    )


def read_metadata(path: str | os.PathLike[str], reader: StorageReader | None = None) -> Metadata:
    """The DCP metadata of checkpoint ``path``, read by ``reader`` (a safe one, see
    :class:`SafeMetadata`; by default the :class:`SafeFileSystemReader` of folder ``path``), or
    a one-line :class:`CheckpointError` naming ``path``."""
    try:
        return (reader or SafeFileSystemReader(path)).read_metadata()
    except FileNotFoundError as e:
        raise damaged(path, "it has no .metadata") from e
    except Exception as e:
        raise damaged(path, f"cannot read its .metadata ({one_line(e)})") from e


def read_checkpoint(
    path: str | os.PathLike[str], prefix: str = "", reader: StorageReader | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint folder ``path`` whose key starts with ``prefix``, as full
    tensors by flattened key (``model.layers.0.attention.wq.weight``), read in this process
    alone: to inspect or export a checkpoint, or to compare two. ``reader``: a safe reader of
    it on another medium (a ``CheckpointStorage``'s), for a checkpoint that is no folder."""
    if reader is None:
        path = Path(path)
    metadata = read_metadata(path, reader)
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        # DCP warns that it assumes one process when torch.distributed is not set up,
        # which is exactly what no_dist asks for.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            state,
            storage_reader=reader or SafeFileSystemReader(path),
            planner=TensorOnlyLoadPlanner(),
            no_dist=True,
        )
    return state


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
