"""``plugtrain prepare-data``: documents tokenized in parallel into a prepared folder.

Streaming, atomic and idempotent.

The inputs are read as a stream of documents cut into chunks of about ``CHUNK_BYTES``; worker
processes encode chunks (``tokenizers``, one thread each) while the parent writes the results
in chunk order, so the bytes written are the same for any number of workers, and at most
``2 * workers`` chunks are in memory at once whatever the corpus size. Each document becomes
``[bos] tokens [eos]`` (tests check it against :mod:`plugtrain.testing.reference`). A shard is
closed when it holds ``shard_tokens`` tokens or more, at a chunk boundary.

Chat data (:mod:`plugtrain.data.chat`) is one document per conversation: the chat template's
tokens as they are (the template places its own BOS and end-of-turn tokens), and beside each
shard a ``shard_NNNNN.mask`` of one byte per token, 1 for the assistant's; the manifest's
``chat`` says how many conversations were kept, truncated and dropped, and holds the chat
template's text and record (a run on the folder records the template it trained with).

Preference data (:mod:`plugtrain.data.preference`) is chat data too: each pair's chosen and
rejected sides are two documents, packed into samples of ``max_tokens + 1`` tokens; the
manifest's ``chat`` counts the pairs and says ``"preference": true``.

Progress counts the bytes of the input files read (compressed ones included), against their
total size: a bar on a terminal, otherwise a line every ``PROGRESS_EVERY`` seconds.

Everything is written to ``<out>.partial/`` and fsynced; only a complete folder is renamed to
``<out>``. On any error (a full disk, an interrupt) the partial folder is removed; one left by
a killed process is replaced by the next run and never read (it has another name).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import tqdm

from plugtrain.data.chat import (
    ChatEncoder,
    ChatOptions,
    ChatTemplate,
    fitting_seq_len,
    length_percentiles,
)
from plugtrain.data.preference import PairPacker, PreferencePair
from plugtrain.data.sources import check_extras, expand_inputs, is_chat, iter_documents
from plugtrain.data.store import FORMAT_VERSION, MANIFEST, file_sha256, token_dtype
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError

CHUNK_BYTES = 1 << 20
"""Input bytes per chunk of documents a worker encodes at once."""
SHARD_TOKENS = 1 << 28
"""Default tokens per shard (512 MiB of uint16): few files, each easily copied or checked."""
PROGRESS_EVERY = 30.0
"""Seconds between progress lines when stderr is not a terminal (a scheduler's log)."""


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare` did: the folder, whether it was (re)written, and its numbers."""

    folder: Path
    written: bool
    num_tokens: int
    seconds: float
    input_bytes: int


def _source_record(path: Path, *, with_hash: bool) -> dict[str, Any]:
    st = path.stat()
    record: dict[str, Any] = {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    if with_hash:
        record["sha256"] = file_sha256(path)
    return record


@dataclass(frozen=True)
class Layout:
    """What, besides the inputs and tokenizer, decides the bytes written (not ``workers``)."""

    text_field: str = "text"
    shard_tokens: int = SHARD_TOKENS
    chunk_bytes: int = CHUNK_BYTES


def _inputs_key(
    sources: list[dict[str, Any]],
    tokenizer_sha: str,
    layout: Layout,
    chat: ChatEncoder | None,
) -> dict[str, Any]:
    """What a prepared folder must have been made from to be up to date."""
    key = {
        "sources": [{k: s[k] for k in ("path", "size", "mtime_ns")} for s in sources],
        "tokenizer": tokenizer_sha,
        **dataclasses.asdict(layout),
    }
    if chat is not None:
        key["chat"] = chat.key()
    return key


def is_up_to_date(out: Path, key: dict[str, Any]) -> bool:
    """Whether ``out`` holds a manifest of this format made from exactly these inputs."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format_version") == FORMAT_VERSION and manifest.get("inputs_key") == key


class _ChunkInfo(NamedTuple):
    """A chunk's ``nbytes`` of text, the file bytes ``read`` for it (the progress), and whether
    it ``ends`` a chunk of the layout (a shard may close after it) or is a piece of one."""

    nbytes: int
    read: int
    ends: bool


def _chunks(
    files: Sequence[Path], field: str, chunk_bytes: int, chat: bool = False
) -> Iterator[tuple[list[Any], _ChunkInfo]]:
    """The documents in chunks of ``chunk_bytes`` of text or more.

    The first chunk comes in pieces of 1/16, 1/8, 1/4... of it, so that progress shows after
    encoding a small piece rather than a whole chunk; the layout's chunks stay the same.
    """
    texts: list[str] = []
    nbytes = read = in_chunk = 0  # in_chunk: the layout chunk's text bytes, pieces included
    piece = chunk_bytes // 16  # 0 once the first chunk is complete: no more pieces
    for path in files:
        position = 0
        for text, size, now_at in iter_documents(path, field, chat=chat):
            texts.append(text)
            nbytes += size
            in_chunk += size
            read += now_at - position
            position = now_at
            ends = in_chunk >= chunk_bytes
            if ends or (piece and nbytes >= piece):
                yield texts, _ChunkInfo(nbytes, read, ends)
                texts, nbytes, read = [], 0, 0
                in_chunk, piece = (0, 0) if ends else (in_chunk, 2 * piece)
        read += path.stat().st_size - position  # read after the last document: a gzip trailer
    if texts or read:
        yield texts, _ChunkInfo(nbytes, read, True)


class Encoded(NamedTuple):
    """A chunk's token stream, each document's length, for chat data the assistant mask (one
    byte per token), how many conversations (preference pairs) were truncated and dropped, and
    how many were of each length before any was cut."""

    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None = None
    truncated: int = 0
    dropped: int = 0
    histogram: np.ndarray | None = None
    pairs: int = 0
    """Preference data: the pairs kept (each two documents; padding makes the rest)."""


_worker_tokenizer: Tokenizer | None = None
_worker_chat: ChatEncoder | None = None


def _init_worker(tokenizer_path: str, chat: ChatEncoder | None) -> None:
    global _worker_tokenizer, _worker_chat
    # One thread per worker: the parallelism is the processes (and no fork warning).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.from_file(tokenizer_path)
    _worker_chat = chat


def encode_chunk(
    texts: list[Any], tokenizer: Tokenizer, dtype: np.dtype, chat: ChatEncoder | None = None
) -> Encoded:
    """The chunk's token stream (``[bos] ids [eos]`` per document; the template's tokens per
    conversation with ``chat``) and each document's length."""
    if chat is not None:
        pairs = sum(isinstance(text, PreferencePair) for text in texts)
        if pairs:  # a preference file's records are all pairs (sources checks it)
            if not chat.max_tokens:
                raise DataError(
                    "preference data is packed into samples of training.seq_len + 1 tokens: "
                    "give the sequence length (prepare-data: --max-tokens SEQ_LEN)"
                )
            packer = PairPacker(chat.template, chat.max_tokens + 1, chat.overlong)
            ids, masks, truncated, dropped, rendered = packer.encode(texts, tokenizer)
        else:
            ids, masks, truncated, dropped, rendered = chat.encode(texts, tokenizer)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter((i for one in ids for i in one), dtype=dtype, count=lengths.sum())
        mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        histogram = np.bincount(np.asarray(rendered, dtype=np.int64), minlength=1)
        return Encoded(tokens, lengths, mask, truncated, dropped, histogram, pairs - dropped)
    encoded = tokenizer.encode_batch(texts)
    head = 0 if tokenizer.bos_id is None else 1
    lengths = np.fromiter(
        (len(ids) + head + 1 for ids in encoded), dtype=np.int64, count=len(encoded)
    )
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    for start, end, ids in zip(starts, ends, encoded, strict=True):
        if head:
            tokens[start] = tokenizer.bos_id
        tokens[start + head : end - 1] = ids
        tokens[end - 1] = tokenizer.eos_id
    return Encoded(tokens, lengths)


def _encode_in_worker(texts: list[Any], dtype: str, info: _ChunkInfo) -> tuple[Encoded, _ChunkInfo]:
    assert _worker_tokenizer is not None
    return encode_chunk(texts, _worker_tokenizer, np.dtype(dtype), _worker_chat), info


def _encoded(
    chunks: Iterator[tuple[list[Any], _ChunkInfo]],
    tokenizer: Tokenizer,
    tokenizer_path: str,
    workers: int,
    chat: ChatEncoder | None,
) -> Iterator[tuple[Encoded, _ChunkInfo]]:
    """Encoded chunks in input order; at most ``2 * workers`` in flight."""
    dtype = token_dtype(tokenizer.vocab_size)
    if workers == 1:
        for texts, info in chunks:
            yield encode_chunk(texts, tokenizer, dtype, chat), info
        return
    context = multiprocessing.get_context("forkserver")
    initargs = (tokenizer_path, chat)
    with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for texts, info in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (texts, dtype.str, info)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _ShardWriter:
    """Appends encoded chunks to ``shard_NNNNN.bin`` / ``.idx`` (and, ``masked``, ``.mask``)
    files, fsynced when closed."""

    def __init__(self, folder: Path, shard_tokens: int, masked: bool = False) -> None:
        self.folder, self.shard_tokens, self.masked = folder, shard_tokens, masked
        self.shards: list[dict[str, Any]] = []
        self._bin = self._idx = self._mask = None
        self._tokens = 0
        self._docs = 0
        self._at_chunk_end = False

    def _open(self) -> None:
        name = f"shard_{len(self.shards):05d}"
        self.shards.append({"file": f"{name}.bin", "index": f"{name}.idx"})
        # Kept open across writes; close() fsyncs and closes them.
        self._bin = open(self.folder / f"{name}.bin", "wb")  # noqa: SIM115
        self._idx = open(self.folder / f"{name}.idx", "wb")  # noqa: SIM115
        if self.masked:
            self.shards[-1]["mask"] = f"{name}.mask"
            self._mask = open(self.folder / f"{name}.mask", "wb")  # noqa: SIM115
        self._tokens = self._docs = 0

    def write(self, encoded: Encoded, info: _ChunkInfo) -> None:
        """Append a chunk; the shard closes before it if full and at a layout chunk's end."""
        tokens, lengths = encoded.tokens, encoded.lengths
        if not len(lengths):
            return  # input read past the last document: nothing to write
        if self._bin is None or (self._tokens >= self.shard_tokens and self._at_chunk_end):
            self.close()
            self._open()
        assert self._bin is not None and self._idx is not None
        _write_bytes(self._bin, tokens.tobytes())
        _write_bytes(self._idx, (np.cumsum(lengths) + self._tokens).astype(np.int64).tobytes())
        if self._mask is not None:
            assert encoded.mask is not None
            _write_bytes(self._mask, encoded.mask.tobytes())
        self._tokens += len(tokens)
        self._docs += len(lengths)
        self._at_chunk_end = info.ends

    def close(self) -> None:
        if self._bin is None:
            return
        for f in (self._bin, self._idx, self._mask):
            if f is None:
                continue
            f.flush()
            os.fsync(f.fileno())
            f.close()
        path = self.folder / self.shards[-1]["file"]
        self.shards[-1].update(
            num_tokens=self._tokens,
            num_documents=self._docs,
            size=path.stat().st_size,
            sha256=file_sha256(path),
        )
        self._bin = self._idx = self._mask = None


def _write_bytes(f: Any, data: bytes) -> None:
    """``f.write(data)``; the one place the writer writes, so a test can fill the disk here."""
    f.write(data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold ``<out>.lock`` so that two processes never prepare the same folder at once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check_sizes(sizes: dict[str, int]) -> None:
    """Refuse, naming the option, a count of workers, tokens or bytes below 1."""
    for name, value in sizes.items():
        if value < 1:
            raise DataError(f"{name} must be >= 1, got {value}")


def _commit(partial: Path, out: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` into the complete ``partial`` folder, then make it ``out``, durably:
    a crash at any moment leaves the old ``out`` or the new one, never a part of it."""
    with open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
    if out.exists():
        shutil.rmtree(out)
    os.rename(partial, out)
    _fsync_dir(out.parent)


def prepare(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    tokenizer_path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    workers: int | None = None,
    shard_tokens: int = SHARD_TOKENS,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool | None = None,
    progress_every: float = PROGRESS_EVERY,
    chat: ChatOptions | None = None,
) -> PrepareResult:
    """Prepare ``inputs`` (files, folders, globs) into the folder ``out``; see the module doc.

    ``chat`` says which files are chat data (every file must be of the same kind) and how
    conversations are rendered and cut (default :class:`~plugtrain.data.chat.ChatOptions`:
    detected, with no length limit).

    ``workers`` defaults to every core. ``progress`` True shows a bar, False nothing, None a
    bar on a terminal and otherwise a line every ``progress_every`` seconds (on stderr).
    An up-to-date ``out`` (same inputs by path, size and mtime, same tokenizer and layout) is
    left as it is and reported with ``written=False``.
    """
    begin = time.perf_counter()
    out = Path(out)
    files = expand_inputs(inputs)
    check_extras(files)
    workers = workers or os.cpu_count() or 1
    _check_sizes({"--workers": workers, "--shard-tokens": shard_tokens, "chunk_bytes": chunk_bytes})
    layout = Layout(text_field, shard_tokens, chunk_bytes)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer_sha = file_sha256(tokenizer_path)
    encoder = chat_encoder(files, tokenizer_path, chat or ChatOptions())
    with _locked(out):
        key = _inputs_key(
            [_source_record(f, with_hash=False) for f in files], tokenizer_sha, layout, encoder
        )
        if is_up_to_date(out, key):
            manifest = json.loads((out / MANIFEST).read_text())
            return PrepareResult(out, False, manifest["num_tokens"], time.perf_counter() - begin, 0)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # left by a killed run: never read
        partial.mkdir()
        try:
            chunks = _encoded(
                _chunks(files, text_field, chunk_bytes, encoder is not None),
                tokenizer,
                str(tokenizer_path),
                workers,
                encoder,
            )
            total_bytes = sum(f.stat().st_size for f in files)
            progress_bar = _Progress(total_bytes, progress, progress_every)
            manifest = _write(chunks, partial, tokenizer, layout, progress_bar, encoder)
            _check_not_empty(manifest, inputs)
            manifest.update(
                inputs_key=key,
                sources=[_source_record(f, with_hash=True) for f in files],
                tokenizer={
                    "path": str(Path(tokenizer_path).resolve()),
                    "sha256": tokenizer_sha,
                    "vocab_size": tokenizer.vocab_size,
                },
            )
            _commit(partial, out, manifest)
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise DataError(
                    f"disk full while preparing '{out}' (partial output removed; '{out}' was not "
                    f"touched): free space on its disk or choose another output folder"
                ) from e
            raise
    seconds = time.perf_counter() - begin
    return PrepareResult(out, True, manifest["num_tokens"], seconds, manifest["input_bytes"])


def _check_not_empty(manifest: dict[str, Any], inputs: Sequence[str]) -> None:
    """Refuse a prepared folder of no documents, saying why: empty inputs, or conversations
    (preference pairs) all too long for a sample and dropped."""
    if manifest["num_documents"]:
        return
    chat = manifest.get("chat") or {}
    if chat.get("dropped"):
        raise DataError(
            f"inputs {list(inputs)}: all {chat['dropped']} conversations or pairs are too long "
            f"for {chat['max_tokens']} tokens and were dropped"
            f"{fitting_seq_len(chat) or ': raise training.seq_len'}"
        )
    raise DataError(f"inputs {list(inputs)} hold no documents: give non-empty files")


def chat_encoder(
    files: Sequence[Path], tokenizer_path: str | os.PathLike[str], chat: ChatOptions
) -> ChatEncoder | None:
    """The encoder of chat ``files``, or None for text; files of both kinds are refused."""
    kinds = {f: is_chat(f, chat.format) for f in files}
    if len(set(kinds.values())) > 1:
        chats = [str(f) for f, c in kinds.items() if c]
        raise DataError(
            f"inputs mix chat data ({', '.join(chats)}) with text: prepare each kind into its own "
            f"folder and mix them with data.sources"
        )
    if not any(kinds.values()):
        return None
    template = ChatTemplate.for_tokenizer(tokenizer_path, chat.template)
    return ChatEncoder(template, chat.max_tokens, chat.overlong)


class _Progress:
    """Progress in bytes of the input files read: a tqdm bar, or lines for a log (see
    :func:`prepare`'s ``progress``)."""

    def __init__(self, total: int, progress: bool | None, every: float) -> None:
        terminal = sys.stderr.isatty()
        self.total, self.every = total, every
        self.lines = progress is None and not terminal
        self.bar = tqdm.tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="prepare-data",
            disable=not (progress or (progress is None and terminal)),
        )
        self.done = self.tokens = 0
        self.start = self.last_line = time.perf_counter()

    def update(self, read: int, tokens: int) -> None:
        """Count ``read`` more bytes of input and ``tokens`` more tokens written."""
        self.done += read
        self.tokens += tokens
        now = time.perf_counter()
        seconds = max(now - self.start, 1e-9)
        self.bar.update(read)
        self.bar.set_postfix_str(f"{self.tokens / 1e6 / seconds:.2f}M tok/s")
        if self.lines and now - self.last_line >= self.every:
            self.last_line = now
            eta = "?"
            if self.done:
                eta = _clock(seconds * (self.total - self.done) / self.done)
            print(
                f"prepare-data: {100 * self.done / max(self.total, 1):.1f}% of "
                f"{self.total / 1e6:.1f} MB read, {self.done / 1e6 / seconds:.2f} MB/s, "
                f"{self.tokens / 1e6 / seconds:.2f}M tokens/s, ETA {eta}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def _write(
    chunks: Iterator[tuple[Encoded, _ChunkInfo]],
    folder: Path,
    tokenizer: Tokenizer,
    layout: Layout,
    progress: _Progress,
    chat: ChatEncoder | None,
) -> dict[str, Any]:
    """Write the encoded chunks into ``folder``'s shards; return the manifest's counts."""
    writer = _ShardWriter(folder, layout.shard_tokens, masked=chat is not None)
    num_tokens = num_docs = input_bytes = truncated = dropped = pairs = 0
    # Conversations by length, uncut: bounded by the longest, however many there are.
    histogram = np.zeros(1, np.int64)
    with closing(progress):
        for encoded, info in chunks:
            writer.write(encoded, info)
            num_tokens += len(encoded.tokens)
            num_docs += len(encoded.lengths)
            truncated += encoded.truncated
            dropped += encoded.dropped
            pairs += encoded.pairs
            if encoded.histogram is not None:
                longer = max(len(histogram), len(encoded.histogram))
                histogram = np.pad(histogram, (0, longer - len(histogram)))
                histogram[: len(encoded.histogram)] += encoded.histogram
            input_bytes += info.nbytes
            progress.update(info.read, len(encoded.tokens))
        writer.close()
    extra: dict[str, Any] = {}
    if chat is not None:
        extra["chat"] = {
            "template": chat.template.origin,
            **chat.key(),
            # The text itself: a run on this folder records the template it trained with.
            "template_source": chat.template.source,
            "template_record": chat.template.record(),
            "conversations": (pairs if pairs else num_docs) + dropped,
            "truncated": truncated,
            "dropped": dropped,
            # Token lengths before cutting: the run's line on cut ones names a seq_len that fits.
            "lengths": length_percentiles(histogram),
        }
        if pairs:  # preference data: the conversations above are its pairs
            extra["chat"]["preference"] = True
    return {
        "format_version": FORMAT_VERSION,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "input_bytes": input_bytes,
        "layout": dataclasses.asdict(layout),
        "shards": writer.shards,
        **extra,
    }
