"""Hugging Face export: time and peak memory of ``plugtrain export-hf`` against the model size.

For each shape (the tiny and debug flavors, and a ~300M-parameter shape made for the bench,
``bench300M``: dim 1024, 24 layers, 16 heads, 8 KV heads) a randomly initialised fp32 model
is saved as a DCP checkpoint (``model.*`` keys and the run's ``config.json``, as a run saves
them), then exported to bf16 in a fresh process, which reports its wall time and peak RSS.
The same process shape, importing the same modules and exporting nothing, gives the baseline
RSS; ``extra`` is the export's peak above it, to compare with the model's size and its largest
tensor. The reference is the straightforward export that holds the model: every tensor read
(``read_checkpoint``), converted to bf16, and written by ``safetensors.torch.save_file``.

    python bench/export.py            # a few minutes; 2 GB of disk in the temp folder
    python bench/export.py --quick    # seconds: tiny only
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import torch.distributed.checkpoint as dcp

from plugtrain.data.tokenizer import Tokenizer
from plugtrain.model.llama.transformer import FLAVORS, Transformer

TOKENIZER = benchlib.DATA / "tokenizer.json"
SEQ_LEN = 128
BENCH_SHAPE = dataclasses.replace(
    FLAVORS["debug"], dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, multiple_of=256
)
"""The bench's ~300M-parameter shape (vocab from the sample's tokenizer)."""

# Run in a fresh process: MODE is "stream" (plugtrain's export), "hold" (the whole model in
# memory) or "none" (the imports only); prints wall seconds and peak RSS in KiB.
EXPORT = """
import json, sys, time
import torch
from plugtrain.checkpoint.dcp_io import read_checkpoint
from plugtrain.checkpoint.export import export_checkpoint
from plugtrain.model.llama.args import run_model_args
from plugtrain.model.llama.hf import to_hf
from plugtrain.model.llama.transformer import FLAVORS, ModelArgs
import safetensors.torch
mode, checkpoint, out, shape = sys.argv[1:5]
FLAVORS["bench300M"] = ModelArgs(**json.loads(shape))
start = time.perf_counter()
if mode == "stream":
    export_checkpoint(checkpoint, out, dtype=torch.bfloat16)
elif mode == "hold":
    import pathlib
    config = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    state = read_checkpoint(checkpoint, "model.")
    vocab_size = state["model.tok_embeddings.weight"].shape[0]
    args = run_model_args(config["model"]["flavor"], vocab_size, config["training"]["seq_len"])
    converted = dict(to_hf(k.removeprefix("model."), v, args) for k, v in state.items())
    pathlib.Path(out).mkdir()
    safetensors.torch.save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in converted.items()},
        str(pathlib.Path(out) / "model.safetensors"),
    )
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec from the parent.
peak = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]
print(time.perf_counter() - start, peak)
"""


def save_checkpoint(flavor: str, folder: Path) -> dict[str, int]:
    """A checkpoint of a random ``flavor`` model in ``folder``; its parameter bytes."""
    args = BENCH_SHAPE if flavor == "bench300M" else FLAVORS[flavor]
    args = dataclasses.replace(args, vocab_size=Tokenizer.from_file(TOKENIZER).vocab_size)
    model = Transformer(args)
    model.init_weights(0)
    state = model.state_dict()
    dcp.save({"model": state}, checkpoint_id=folder, no_dist=True)
    run_config = {
        "model": {"flavor": flavor, "tokenizer_path": str(TOKENIZER)},
        "training": {"seq_len": SEQ_LEN},
    }
    (folder / "config.json").write_text(json.dumps(run_config))
    return {
        "parameters": sum(t.numel() for t in state.values()),
        "model_mib": sum(t.nbytes for t in state.values()) / 2**20,
        "largest_tensor_mib": max(t.nbytes for t in state.values()) / 2**20,
    }


def measure(mode: str, checkpoint: Path, out: Path) -> dict[str, float]:
    shape = json.dumps(dataclasses.asdict(BENCH_SHAPE))
    done = subprocess.run(
        [sys.executable, "-c", EXPORT, mode, str(checkpoint), str(out), shape],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"export ({mode}) of {checkpoint} failed:\n{done.stderr}")
    seconds, rss = done.stdout.split()
    return {"seconds": float(seconds), "peak_rss_mib": int(rss) / 1024}


def main() -> None:
    args = benchlib.parse_args("export", __doc__.splitlines()[0])
    flavors = ["tiny"] if args.quick else ["tiny", "debug", "bench300M"]
    results = []
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        for flavor in flavors:
            checkpoint = Path(tmp) / flavor / "step-1"
            start = time.perf_counter()
            row = {"flavor": flavor, **save_checkpoint(flavor, checkpoint)}
            row["save_seconds"] = time.perf_counter() - start
            baseline = measure("none", checkpoint, Path(tmp) / "none")
            for mode in ("stream", "hold"):
                row[mode] = measure(mode, checkpoint, Path(tmp) / flavor / mode)
                row[mode]["extra_mib"] = row[mode]["peak_rss_mib"] - baseline["peak_rss_mib"]
            row["baseline_rss_mib"] = baseline["peak_rss_mib"]
            results.append(row)
    headers = ["flavor", "parameters", "model fp32 MiB", "largest tensor MiB", "export s",
               "export extra RSS MiB", "hold-all s", "hold-all extra RSS MiB"]  # fmt: skip
    rows = [
        [r["flavor"], r["parameters"], r["model_mib"], r["largest_tensor_mib"],
         r["stream"]["seconds"], r["stream"]["extra_mib"],
         r["hold"]["seconds"], r["hold"]["extra_mib"]]
        for r in results
    ]  # fmt: skip
    print(benchlib.table(headers, rows))
    benchlib.write_json(args.out, "export", args, results)


if __name__ == "__main__":
    main()
