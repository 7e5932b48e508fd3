"""The run's token stores: a prepared folder as is, or a data file prepared once into a cache.

So that ``python train.py`` on a JSONL file needs no extra command, a file path is prepared
(:func:`plugtrain.data.prepare.prepare`) into ``$PLUGTRAIN_CACHE`` (default
``$XDG_CACHE_HOME/plugtrain``, else ``~/.cache/plugtrain``), in a folder named after the file's
absolute path, the tokenizer's sha256 and the text field (for chat data, the chat options too).
``prepare`` redoes it only when the file's size or mtime changed. Rank 0 prepares while the
other ranks wait at a barrier; then every rank opens the folder by memory map.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from plugtrain.data.chat import ChatOptions
from plugtrain.data.prepare import prepare
from plugtrain.data.sources import is_chat
from plugtrain.data.store import TokenStore, file_sha256
from plugtrain.errors import MissingFileError

logger = logging.getLogger("plugtrain")

PARALLEL_BYTES = 64 << 20
"""Files at least this large are prepared by a worker per core; smaller ones in-process."""
REPORT_SECONDS = 5.0
"""A preparation that took this long is logged (where the start-up time went)."""


def cache_root() -> Path:
    """Where prepared copies of data files go: ``$PLUGTRAIN_CACHE``, or the user's cache."""
    if override := os.environ.get("PLUGTRAIN_CACHE"):
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "plugtrain"


def cache_folder(
    path: Path, tokenizer_sha256: str, text_field: str, chat: ChatOptions | None = None
) -> Path:
    """The cache folder of data file ``path`` for this tokenizer and text field, or for chat
    data these ``chat`` options."""
    resolved = path.resolve()
    key = f"{resolved}\0{tokenizer_sha256}\0{text_field}".encode()
    if chat is not None:
        key += b"\0" + json.dumps(dataclasses.asdict(chat), sort_keys=True).encode()
    return cache_root() / f"{resolved.name}-{hashlib.sha256(key).hexdigest()[:16]}"


def open_token_store(
    path: str | os.PathLike[str],
    key: str,
    tokenizer_path: str | os.PathLike[str],
    text_field: str,
    *,
    chat: ChatOptions | None = None,
    is_main: bool = True,
    barrier: Callable[[], None] | None = None,
) -> TokenStore:
    """The token store of config key ``key``'s ``path``: a prepared folder, or a data file
    prepared into the cache (by the main rank only; ``barrier`` makes the others wait);
    ``chat`` says whether and how a file is read as chat data (default: detected)."""
    path = Path(path)
    tokenizer_sha256 = file_sha256(tokenizer_path)
    if path.is_dir():
        return TokenStore(path, tokenizer_sha256=tokenizer_sha256, key=key)
    if not path.is_file():
        raise MissingFileError(
            f"data file '{path}' not found: set {key} to a JSONL file with one "
            f"{{{text_field!r}: ...}} per line, or to a folder written by plugtrain prepare-data"
        )
    chat = chat or ChatOptions()
    as_chat = is_chat(path, chat.format, label=key)
    folder = cache_folder(path, tokenizer_sha256, text_field, chat if as_chat else None)
    if is_main:
        workers = None if path.stat().st_size >= PARALLEL_BYTES else 1
        result = prepare(
            [str(path)],
            folder,
            tokenizer_path,
            text_field=text_field,
            workers=workers,
            chat=chat,
        )
        # Said when it delays the start noticeably (a terminal shows the progress bar anyway).
        if result.written and result.seconds >= REPORT_SECONDS:
            logger.info(
                "prepared %s '%s' into %s: %d tokens in %.1f s (once; later runs reuse it)",
                key,
                path,
                folder,
                result.num_tokens,
                result.seconds,
            )
    if barrier is not None:
        barrier()
    return TokenStore(folder, tokenizer_sha256=tokenizer_sha256, key=key)
