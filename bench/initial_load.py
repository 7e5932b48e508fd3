"""Initial load: time and peak memory of loading a Hugging Face folder into the sharded model.

The bench saves a random-weight ``LlamaForCausalLM`` (``plugtrain.testing.save_random_llama``)
in bf16, of the ~300M-parameter shape of ``bench/export.py`` (``bench300M``: dim 1024, 24
layers, 16 heads, 8 KV heads), or the tiny flavor's with ``--quick``. Then, on 1 and on 2
processes (on 2 only with ``--quick``; gloo, started by torchrun), fresh processes build the
run's model as the trainer does (meta device, FSDP2 on 2 processes, no ``init_weights``) and:

* ``none``: load nothing (the baseline: imports and the model's own memory, written once so
  that it is resident);
* ``initial``: ``checkpoint.initial_load_path``'s load (each rank reads its rows of each
  tensor through safetensors' slices, casts them to fp32);
* ``hold``: the straightforward load: every rank reads the whole folder
  (``safetensors.torch.load_file``), converts it (``from_hf``, fp32) and keeps its shard
  (``set_model_state_dict`` with a full state dict).

Each rank reports its wall time and its peak RSS (``VmHWM``); *extra* is a mode's peak above
the baseline's (which holds the model's shard), on the rank where it is largest: what loading
costs beyond the model itself, to compare with the model's size.

    python bench/initial_load.py            # 9 minutes at load 22 on 2 cores; 0.6 GB temp disk
    python bench/initial_load.py --quick    # the tiny shape on 2 processes: the script runs (30 s)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import torch

from plugtrain.data import Tokenizer
from plugtrain.model import FLAVORS
from plugtrain.testing import free_port, save_random_llama

BENCH_SHAPE = dataclasses.replace(
    FLAVORS["debug"], dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, multiple_of=256
)
"""bench/export.py's ~300M-parameter shape (vocab from the sample's tokenizer)."""

# One rank of a measurement, under torchrun: argv MODE FOLDER OUT; writes OUT/rank<r>.json.
WORKER = """
import json, sys, time
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from safetensors.torch import load_file
from plugtrain.checkpoint import open_initial_load
from plugtrain.config import CheckpointConfig
from plugtrain.model import LLAMA, build_model, from_hf, model_args_from_hf
torch.set_num_threads(1)
mode, folder, out = sys.argv[1:4]
dist.init_process_group("gloo")
world = dist.get_world_size()
args = model_args_from_hf(json.load(open(f"{folder}/config.json")))
model = build_model(
    LLAMA, args, init_device_mesh("cpu", (world,)), torch.float32, torch.float32,
    torch.device("cpu"), 0, init_weights=False,
)
with torch.no_grad():  # resident, as in a run: to_empty's pages are not until written
    for param in model.parameters():
        getattr(param, "_local_tensor", param).zero_()
dist.barrier()
start = time.perf_counter()
if mode == "initial":
    source = open_initial_load(CheckpointConfig(initial_load_path=folder))
    source.check(model, args, "the bench's")
    source.load(model, None, args)
elif mode == "hold":
    full = load_file(f"{folder}/model.safetensors")
    state = dict(from_hf(k, v.float(), args) for k, v in full.items())
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec from the parent.
peak = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
    json.dump({"seconds": seconds, "peak_rss_mib": int(peak) / 1024}, f)
dist.destroy_process_group()
"""


def measure(script: Path, mode: str, folder: Path, nproc: int) -> dict[str, float]:
    """The slowest rank's seconds and the largest peak RSS of ``mode`` on ``nproc`` ranks."""
    # A file per rank: lines the ranks print to one pipe can interleave.
    with tempfile.TemporaryDirectory(prefix="ranks-") as out:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
             "--master_addr=127.0.0.1", f"--master_port={free_port()}",
             str(script), mode, str(folder), out],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"{mode} on {nproc} process(es) failed:\n{done.stderr}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {
        "seconds": max(r["seconds"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
    }


def main() -> None:
    args = benchlib.parse_args("initial_load", __doc__.splitlines()[0])
    vocab = Tokenizer.from_file(benchlib.DATA / "tokenizer.json").vocab_size
    shape = dataclasses.replace(FLAVORS["tiny"] if args.quick else BENCH_SHAPE, vocab_size=vocab)
    results = []
    with tempfile.TemporaryDirectory(prefix="initial-load-") as tmp:
        folder = Path(tmp) / "hf"
        start = time.perf_counter()
        save_random_llama(folder, shape, dtype=torch.bfloat16)
        save_seconds = time.perf_counter() - start
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        parameters = shape.num_params()
        for nproc in (2,) if args.quick else (1, 2):
            row = {"processes": nproc, "parameters": parameters,
                   "model_fp32_mib": parameters * 4 / 2**20,
                   "folder_bf16_mib": (folder / "model.safetensors").stat().st_size / 2**20,
                   "save_seconds": save_seconds}  # fmt: skip
            baseline = measure(script, "none", folder, nproc)
            row["baseline_rss_mib"] = baseline["peak_rss_mib"]
            for mode in ("initial", "hold"):
                row[mode] = measure(script, mode, folder, nproc)
                row[mode]["extra_mib"] = row[mode]["peak_rss_mib"] - baseline["peak_rss_mib"]
            results.append(row)
    headers = ["processes", "parameters", "model fp32 MiB", "baseline RSS MiB", "initial load s",
               "initial extra RSS MiB", "hold-all s", "hold-all extra RSS MiB"]  # fmt: skip
    rows = [
        [r["processes"], r["parameters"], r["model_fp32_mib"], r["baseline_rss_mib"],
         r["initial"]["seconds"], r["initial"]["extra_mib"],
         r["hold"]["seconds"], r["hold"]["extra_mib"]]
        for r in results
    ]  # fmt: skip
    print(benchlib.table(headers, rows))
    benchlib.write_json(args.out, "initial_load", args, results)


if __name__ == "__main__":
    main()
