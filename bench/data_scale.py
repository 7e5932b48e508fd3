"""Data at scale: prepare throughput, and start-up time and memory against the corpus size.

Generates synthetic JSONL corpora (paragraphs of the shipped Shakespeare, shuffled; 10 MB,
100 MB and 1 GB) in a temporary folder, then measures:

- ``plugtrain prepare-data`` throughput (MB/s, tokens/s) with 1 and 2 workers, against one
  process calling ``tokenizers``' ``encode_batch`` (single-threaded, encode time only) over
  the same texts: ``ratio_per_worker`` = prepare tokens/s / (baseline tokens/s x workers);
- for each prepared corpus, a fresh ``python train.py`` of the debug model for one step:
  wall time from start to exit after step 1, and peak RSS;
- the same on a store of 2B random uint16 tokens written directly (no tokenizer);
- the loader's share of the step time (``time_data_s / time_step_s``) over 20 steps.

    python bench/data_scale.py                 # ~1 GB in /tmp and 4 GB for the 2B store
    python bench/data_scale.py --sizes 10,100  # MB
    python bench/data_scale.py --quick         # seconds: checks that it runs
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import numpy as np

from plugtrain.data.prepare import prepare
from plugtrain.data.store import FORMAT_VERSION, MANIFEST, file_sha256
from plugtrain.data.tokenizer import Tokenizer

TOKENIZER = benchlib.DATA / "tokenizer.json"
MB = 1 << 20
# A fresh process that runs train.py and prints its peak RSS (ru_maxrss of its only child).
RUN_AND_MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run([sys.executable, *sys.argv[1:]], stdout=subprocess.DEVNULL).returncode
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def make_corpus(path: Path, size: int) -> None:
    """About ``size`` bytes of JSONL: Shakespeare's paragraphs, shuffled, ~20 a document."""
    paragraphs = [
        p
        for split in ("train", "validation")
        for line in (benchlib.DATA / f"{split}.jsonl").read_text().splitlines()
        for p in json.loads(line)["text"].split("\n\n")
    ]
    rng = random.Random(0)
    written = 0
    with path.open("w") as f:
        while written < size:
            line = json.dumps({"text": "\n\n".join(rng.choices(paragraphs, k=20))}) + "\n"
            f.write(line)
            written += len(line)


def baseline(path: Path) -> dict[str, float]:
    """One process, one thread, ``encode_batch`` over 1 MB chunks: encode time only."""
    tokenizer = Tokenizer.from_file(TOKENIZER)
    seconds, tokens, chunk, size = 0.0, 0, [], 0

    def encode() -> None:
        nonlocal seconds, tokens
        start = time.perf_counter()
        tokens += sum(len(ids) + 2 for ids in tokenizer.encode_batch(chunk))  # + bos, eos
        seconds += time.perf_counter() - start

    with path.open() as f:
        for line in f:
            chunk.append(json.loads(line)["text"])
            size += len(line)
            if size >= MB:
                encode()
                chunk, size = [], 0
    if chunk:
        encode()
    return {"mb_per_s": path.stat().st_size / MB / seconds, "tokens_per_s": tokens / seconds}


def train_once(folder: Path, run: Path, flavor: str, steps: int = 1) -> dict[str, float]:
    """Wall time and peak RSS of ``python train.py`` for ``steps`` steps on ``folder``."""
    args = [
        str(benchlib.REPO / "train.py"),
        "--job.dump_folder", str(run),
        "--model.flavor", flavor,
        "--model.tokenizer_path", str(TOKENIZER),
        "--data.train_path", str(folder),
        "--training.steps", str(steps),
        "--training.batch_size", "8",
        "--training.seq_len", "128",
        "--validation.interval", "0",
        "--metrics.log_freq", "1",
        "--checkpoint.save_final", "false",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", RUN_AND_MEASURE, *args], capture_output=True, text=True, check=True
    ).stdout.split()
    if out[2] != "0":
        raise RuntimeError(f"train.py failed on {folder}: rerun {' '.join(args)}")
    return {"seconds": float(out[0]), "peak_rss_mb": int(out[1]) / 1024}


def random_store(folder: Path, num_tokens: int, shard_tokens: int = 1 << 28) -> None:
    """A prepared folder of ``num_tokens`` random uint16 tokens below the tokenizer's vocab."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    vocab = Tokenizer.from_file(TOKENIZER).vocab_size
    shards = []
    for i, start in enumerate(range(0, num_tokens, shard_tokens)):
        n = min(shard_tokens, num_tokens - start)
        name = f"shard_{i:05d}"
        with open(folder / f"{name}.bin", "wb") as f:
            for piece in range(0, n, 1 << 26):
                rng.integers(0, vocab, min(1 << 26, n - piece), dtype=np.uint16).tofile(f)
        np.array([n], dtype=np.int64).tofile(folder / f"{name}.idx")  # one document a shard
        shards.append({"file": f"{name}.bin", "index": f"{name}.idx", "num_tokens": n})
    manifest = {
        "format_version": FORMAT_VERSION,
        "dtype": "uint16",
        "num_tokens": num_tokens,
        "num_documents": len(shards),
        "shards": shards,
        "sources": [],
        "tokenizer": {
            "path": str(TOKENIZER),
            "sha256": file_sha256(TOKENIZER),
            "vocab_size": vocab,
        },
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def data_share(run: Path) -> float:
    """Median of ``time_data_s / time_step_s`` over the run's steps after the first."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["time_data_s"] / r["time_step_s"] for r in rows if "time_data_s" in r][1:]
    return float(np.median(shares))


def main() -> None:
    def add(parser):
        parser.add_argument("--sizes", default="10,100,1024", help="corpus sizes in MB")
        parser.add_argument("--store-tokens", type=int, default=2_000_000_000)

    args = benchlib.parse_args("data_scale", __doc__.splitlines()[0], add)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as the workers
    sizes = [0.25] if args.quick else [float(s) for s in args.sizes.split(",")]
    quick_steps = 3 if args.quick else 1
    store_tokens = 4_000_000 if args.quick else args.store_tokens
    flavor = "tiny" if args.quick else "debug"
    results: dict = {"corpora": [], "store": {}, "data_share": None}
    with tempfile.TemporaryDirectory(prefix="data_scale-") as tmp:
        tmp = Path(tmp)
        for size_mb in sizes:
            corpus = tmp / f"corpus_{size_mb:g}MB.jsonl"
            make_corpus(corpus, int(size_mb * MB))
            row = {"size_mb": size_mb, "baseline": baseline(corpus), "prepare": {}}
            for workers in (1, 2):
                out = tmp / f"prepared_{size_mb:g}_{workers}"
                done = prepare([str(corpus)], out, TOKENIZER, workers=workers, progress=False)
                tps = done.num_tokens / done.seconds
                row["prepare"][workers] = {
                    "mb_per_s": corpus.stat().st_size / MB / done.seconds,
                    "tokens_per_s": tps,
                    "ratio_per_worker": tps / (row["baseline"]["tokens_per_s"] * workers),
                }
                if workers == 2:
                    shutil.rmtree(out)
            row["tokens"] = done.num_tokens
            prepared = tmp / f"prepared_{size_mb:g}_1"
            # --quick: one run of a few steps gives both numbers (to check that it runs).
            row["train"] = train_once(prepared, tmp / f"run_{size_mb:g}", flavor, quick_steps)
            if size_mb == sizes[0]:
                run = tmp / f"run_{size_mb:g}"
                if not args.quick:
                    run = tmp / "share"
                    train_once(prepared, run, flavor, steps=20)
                results["data_share"] = data_share(run)
            shutil.rmtree(tmp / f"prepared_{size_mb:g}_1")
            corpus.unlink()
            results["corpora"].append(row)
        store = tmp / "store"
        start = time.perf_counter()
        random_store(store, store_tokens)
        results["store"] = {
            "tokens": store_tokens,
            "write_seconds": time.perf_counter() - start,
            "train": train_once(store, tmp / "run_store", flavor, quick_steps),
        }
    rows = [
        [
            f"{r['size_mb']:g} MB",
            r["tokens"],
            r["baseline"]["mb_per_s"],
            r["prepare"][1]["mb_per_s"],
            r["prepare"][1]["ratio_per_worker"],
            r["prepare"][2]["mb_per_s"],
            r["prepare"][2]["ratio_per_worker"],
            r["train"]["seconds"],
            r["train"]["peak_rss_mb"],
        ]
        for r in results["corpora"]
    ]
    store_row = results["store"]
    rows.append([f"store {store_tokens:,} tok", store_tokens, "", "", "", "", "",
                 store_row["train"]["seconds"], store_row["train"]["peak_rss_mb"]])  # fmt: skip
    headers = ["corpus", "tokens", "baseline MB/s", "1 worker MB/s", "ratio", "2 workers MB/s",
               "ratio/worker", "train.py to step 1 (s)", "peak RSS (MB)"]  # fmt: skip
    print(benchlib.table(headers, rows))
    print(
        f"\nloader share of the step time (time_data_s / time_step_s): {results['data_share']:.3%}"
    )
    benchlib.write_json(args.out, "data_scale", args, results)


if __name__ == "__main__":
    main()
