"""Tests of plugtrain prepare-data (plugtrain.data.prepare, .sources) and of reading its
folders (plugtrain.data.store): same bytes for any worker count, every input format, progress,
idempotence, atomicity, and a one-line error for each bad input."""

from __future__ import annotations

import errno
import gzip
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import tqdm

from plugtrain.cli import main
from plugtrain.data import prepare as prepare_module
from plugtrain.data.pipeline import PackedDataset
from plugtrain.data.prepare import prepare
from plugtrain.data.store import MANIFEST, TokenStore, document_offsets, file_sha256
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError, MissingFileError, UserError
from plugtrain.testing import SAMPLE, InMemoryStream, load_jsonl_texts, tokenize_documents

TOKENIZER = SAMPLE / "tokenizer.json"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The validation split cut into its ~800 paragraphs, one document each."""
    texts = [p for t in load_jsonl_texts(SAMPLE / "validation.jsonl") for p in t.split("\n\n")]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def reference(corpus: Path) -> torch.Tensor:
    """The corpus's token stream as the kit's in-memory reference makes it."""
    return tokenize_documents(load_jsonl_texts(corpus), Tokenizer.from_file(TOKENIZER))


def _stream(folder: Path) -> torch.Tensor:
    store = TokenStore(folder, tokenizer_sha256=file_sha256(TOKENIZER))
    return torch.from_numpy(store.read(0, store.num_tokens).astype(np.int32))


def _prepare(inputs: list, out: Path, **kw) -> prepare_module.PrepareResult:
    kw = {"workers": 1, "shard_tokens": 10_000, "chunk_bytes": 20_000, **kw}
    return prepare([str(i) for i in inputs], out, TOKENIZER, **kw)


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[tqdm.tqdm]:
    """The progress bars that prepare makes from now on."""
    made = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(prepare_module.tqdm, "tqdm", Recorded)
    return made


@pytest.fixture
def prepared(tmp_path: Path, corpus: Path) -> Path:
    _prepare([corpus], tmp_path / "val")
    return tmp_path / "val"


def test_prepare_writes_the_pipelines_stream_with_document_boundaries(
    prepared: Path, reference: torch.Tensor, corpus: Path
) -> None:
    assert torch.equal(_stream(prepared), reference)
    manifest = json.loads((prepared / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and len(manifest["shards"]) > 2
    assert manifest["tokenizer"]["sha256"] == file_sha256(TOKENIZER)
    assert manifest["sources"][0]["sha256"] == file_sha256(corpus)
    assert manifest["sources"][0]["size"] == corpus.stat().st_size
    # Every document is [bos] ... [eos]: each boundary is followed by bos, preceded by eos.
    tok = Tokenizer.from_file(TOKENIZER)
    ends = document_offsets(prepared, 0)
    shard = np.fromfile(prepared / "shard_00000.bin", dtype=np.uint16)
    assert ends[-1] == len(shard) and (shard[ends - 1] == tok.eos_id).all()
    assert (shard[np.concatenate([[0], ends[:-1]])] == tok.bos_id).all()
    assert sum(s["num_documents"] for s in manifest["shards"]) == len(load_jsonl_texts(corpus))


def test_same_bytes_for_one_and_two_workers(tmp_path: Path, prepared: Path, corpus: Path) -> None:
    _prepare([corpus], tmp_path / "two", workers=2)
    names = sorted(p.name for p in prepared.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        if name != MANIFEST:
            assert (prepared / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    one, two = (json.loads((f / MANIFEST).read_text()) for f in (prepared, tmp_path / "two"))
    assert one["shards"] == two["shards"]


def test_every_input_format_gives_the_same_stream_and_full_progress(
    tmp_path: Path, reference: torch.Tensor, corpus: Path, bars: list[tqdm.tqdm]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    raw = corpus.read_bytes()
    texts = load_jsonl_texts(corpus)
    (tmp_path / "v.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "v.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": texts}), tmp_path / "v.parquet", row_group_size=7)
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    for i, text in enumerate(texts):  # a folder of .txt files, one document each, sorted
        (tmp_path / "txt" / ("sub" if i % 2 else "") / f"{i:04d}.txt").write_text(text)
    for inputs in (["v.jsonl.gz"], ["v.jsonl.zst"], ["v.parquet"], ["v.json*.gz"]):
        out = tmp_path / f"out_{inputs[0].replace('*', '_')}"
        _prepare([tmp_path / i for i in inputs], out, progress=True)
        assert torch.equal(_stream(out), reference), inputs
        # The bar counts bytes of the files read, compressed or not: it ends at its total.
        sizes = [p.stat().st_size for i in inputs for p in tmp_path.glob(i)]
        assert bars[-1].n == bars[-1].total == sum(sizes), inputs
    _prepare([tmp_path / "txt"], tmp_path / "out_txt", progress=True)
    txt_bytes = sum(p.stat().st_size for p in (tmp_path / "txt").rglob("*.txt"))
    assert bars[-1].n == bars[-1].total == txt_bytes
    order = sorted(range(len(texts)), key=lambda i: str(Path("sub" if i % 2 else "") / f"{i:04d}"))
    expected = tokenize_documents([texts[i] for i in order], Tokenizer.from_file(TOKENIZER))
    assert torch.equal(_stream(tmp_path / "out_txt"), expected)


def test_gz_progress_ends_at_its_total_with_workers(
    tmp_path: Path, corpus: Path, bars: list[tqdm.tqdm]
) -> None:
    gz = tmp_path / "v.jsonl.gz"
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    _prepare([gz, corpus], tmp_path / "out", workers=2, progress=True)
    assert [bar.total for bar in bars] == [gz.stat().st_size + corpus.stat().st_size]
    assert bars[0].n == bars[0].total  # 100%: not past it (uncompressed bytes), not short


def test_a_log_gets_progress_lines(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture
) -> None:
    # capsys's stderr is not a terminal, as a scheduler's log.
    _prepare([corpus], tmp_path / "out", progress_every=0)
    lines = capsys.readouterr().err.splitlines()
    number = r"\d+\.\d+"
    line = (
        rf"prepare-data: {number}% of {number} MB read, {number} MB/s, {number}M tokens/s, "
        r"ETA \d+:\d\d:\d\d"
    )
    assert len(lines) > 1 and all(re.fullmatch(line, text) for text in lines), lines
    size = corpus.stat().st_size / 1e6
    assert lines[-1].startswith(f"prepare-data: 100.0% of {size:.1f} MB read")
    assert lines[-1].endswith("ETA 0:00:00")


def test_the_first_chunk_comes_in_pieces_and_shards_close_at_chunk_ends(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded = []
    encode = prepare_module.encode_chunk

    def recorded(texts: list[str], *args) -> tuple:
        encoded.append(sum(len(t.encode()) for t in texts))
        return encode(texts, *args)

    monkeypatch.setattr(prepare_module, "encode_chunk", recorded)
    chunk = 20_000
    _prepare([corpus], tmp_path / "out", shard_tokens=1, chunk_bytes=chunk)  # a shard per chunk
    # Progress comes after encoding a sixteenth of a chunk, then an eighth...
    assert encoded[0] < chunk / 8 and encoded[0] < encoded[1] < encoded[2] < encoded[3]
    chunk_ends, size = [], 0
    lines = corpus.read_bytes().splitlines(keepends=True)
    for n, line in enumerate(lines, start=1):
        size += len(line)
        if size >= chunk or n == len(lines):
            chunk_ends.append(n)
            size = 0
    shards = json.loads((tmp_path / "out" / MANIFEST).read_text())["shards"]
    assert np.cumsum([s["num_documents"] for s in shards]).tolist() == chunk_ends


def test_up_to_date_folder_is_not_redone(
    tmp_path: Path, capsys: pytest.CaptureFixture, corpus: Path
) -> None:
    source = tmp_path / "v.jsonl"
    shutil.copy(corpus, source)
    args = ["prepare-data", str(source), "-o", str(tmp_path / "out"), "--tokenizer", str(TOKENIZER)]
    assert main([*args, "--workers", "1"]) == 0
    assert "wrote " in capsys.readouterr().out
    before = (tmp_path / "out" / MANIFEST).stat().st_mtime_ns
    assert main([*args, "--workers", "1"]) == 0
    assert "is up to date" in capsys.readouterr().out
    assert (tmp_path / "out" / MANIFEST).stat().st_mtime_ns == before
    with source.open("a") as f:  # a changed input is prepared again
        f.write('{"text": "one more"}\n')
    assert _prepare([source], tmp_path / "out", shard_tokens=1 << 28).written


@pytest.mark.parametrize(
    ("arg", "name"),
    [("workers", "--workers"), ("shard_tokens", "--shard-tokens"), ("chunk_bytes", "chunk_bytes")],
)
def test_a_size_below_1_is_refused_naming_it(tmp_path: Path, corpus: Path, arg: str, name: str):
    with pytest.raises(DataError, match=rf"^{name} must be >= 1, got -1$"):
        _prepare([corpus], tmp_path / "val", **{arg: -1})
    assert not (tmp_path / "val").exists()


def test_disk_full_removes_the_partial_folder_and_keeps_the_old_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, prepared: Path, corpus: Path
) -> None:
    calls = []

    def full(f, data: bytes) -> None:
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(data)

    monkeypatch.setattr(prepare_module, "_write_bytes", full)
    before = {p.name: p.read_bytes() for p in prepared.iterdir()}
    with pytest.raises(DataError, match=r"^disk full while preparing .*val.* free space") as e:
        _prepare([corpus], prepared, shard_tokens=5000)
    assert "\n" not in str(e.value)
    assert not prepared.with_name("val.partial").exists()
    assert {p.name: p.read_bytes() for p in prepared.iterdir()} == before


def test_interrupted_prepare_leaves_nothing_and_a_leftover_partial_is_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, reference: torch.Tensor, corpus: Path
) -> None:
    out = tmp_path / "val"

    def interrupt(f, data: bytes) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "_write_bytes", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _prepare([corpus], out)
    assert not out.exists() and not out.with_name("val.partial").exists()
    monkeypatch.undo()
    # A killed run's leftover: a reader never takes it for the folder, the next run replaces it.
    partial = out.with_name("val.partial")
    partial.mkdir()
    (partial / "shard_00000.bin").write_bytes(b"junk")
    with pytest.raises(MissingFileError, match=r"has no manifest.json: .*plugtrain prepare-data"):
        TokenStore(out)
    _prepare([corpus], out)
    assert not partial.exists() and torch.equal(_stream(out), reference)


def test_fingerprint_mismatch_names_both_tokenizers(tmp_path: Path, prepared: Path) -> None:
    with pytest.raises(DataError) as e:
        TokenStore(prepared, tokenizer_sha256="0" * 64, key="data.validation_path")
    message = str(e.value)
    assert message.startswith(f"data.validation_path '{prepared}' was prepared with another")
    assert str(TOKENIZER.resolve()) in message and "prepare-data' again" in message


def test_truncated_or_missing_shard_is_refused(prepared: Path) -> None:
    shard = prepared / "shard_00001.bin"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    with pytest.raises(DataError, match=rf"^shard {shard} has \d+ bytes, not \d+ \(truncated"):
        TokenStore(prepared)
    shard.unlink()
    with pytest.raises(DataError, match=rf"^shard {shard} is missing .*prepare-data' again"):
        TokenStore(prepared)


def test_unknown_format_version_is_refused(prepared: Path) -> None:
    manifest = json.loads((prepared / MANIFEST).read_text())
    (prepared / MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(DataError, match=r"has format_version 99, but this plugtrain reads only 1"):
        TokenStore(prepared)


def test_corpus_shorter_than_one_sample(prepared: Path) -> None:
    store = TokenStore(prepared)
    with pytest.raises(DataError, match=rf"^data.train_path '{prepared}' has \d+ tokens, fewer"):
        PackedDataset(store, store.num_tokens, source=f"data.train_path '{prepared}'")


def test_samples_read_across_shards_equal_the_in_memory_ones(
    prepared: Path, reference: torch.Tensor
) -> None:
    """Tokens, and the documents and positions from the shards' .idx against those the EOS
    tokens give (this corpus's texts hold none)."""
    flags = {"documents": True, "positions": True}
    stored = PackedDataset(TokenStore(prepared), 4000, **flags)  # samples longer than a shard
    ends = (reference == Tokenizer.from_file(TOKENIZER).eos_id).nonzero().flatten() + 1
    memory = PackedDataset(InMemoryStream(reference, ends.tolist()), 4000, **flags)
    assert len(stored) == len(memory)
    indices = list(reversed(range(len(memory))))
    got, want = stored.collate(indices), memory.collate(indices)
    assert got.samples is None and want.samples is None  # numbered only when a plugin asks
    for a, b, dtype in zip(got[:4], want[:4], (torch.int64,) * 2 + (torch.int32,) * 2, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)
    assert got.documents[:, -1].min() > 5  # each row holds many documents
    starts = got.positions == 0
    assert torch.equal(starts[:, 1:], got.documents.diff(dim=1) == 1)


def test_a_damaged_document_index_is_refused(prepared: Path) -> None:
    index = prepared / "shard_00001.idx"
    with index.open("r+b") as f:
        f.truncate(index.stat().st_size - 8)
    with pytest.raises(DataError, match=rf"^document index {index} has \d+ bytes, not \d+"):
        TokenStore(prepared)


def test_bad_inputs_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MissingFileError, match=r"input '.*nope.jsonl' not found"):
        _prepare([tmp_path / "nope.jsonl"], tmp_path / "out")
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(DataError, match=r"input '.*a.csv' is not a supported type"):
        _prepare([tmp_path / "a.csv"], tmp_path / "out")
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(
        DataError,
        match=r"b.jsonl' line 1 .* field 'text': .*data.text_field \(prepare-data: --text-field\)",
    ):
        _prepare([tmp_path / "b.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    (tmp_path / "c.parquet").write_bytes(b"")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # pyarrow not installed
    with pytest.raises(UserError, match=r"pip install 'plugtrain\[parquet\]'"):
        _prepare([tmp_path / "c.parquet"], tmp_path / "out")


def test_cli_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "o"
    code = main(["prepare-data", str(tmp_path / "x.jsonl"), "-o", str(out), "--tokenizer", "t"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "x.jsonl' not found" in err
    assert not out.exists()


def test_the_data_pages_prepared_folders_are_ignored_by_git() -> None:
    data_page = (REPO / "docs" / "data.md").read_text()
    outputs = re.findall(r"plugtrain prepare-data .* -o (\S+)", data_page)
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert outputs
    for out in outputs:
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/shard_00000.bin"], cwd=REPO)
        assert ignored.returncode == 0, f"{out} (docs/data.md's prepare-data output) is not ignored"
