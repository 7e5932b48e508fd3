"""Checkpoint save and load throughput: a local S3 server (moto's, loopback) against the disk.

The state saved is what a run's checkpoint holds for a model of the given shape in fp32: its
parameters and AdamW's two moments (random values, 3 x 4 bytes per parameter), written and read
by DCP through each store's own writer and reader (``LocalStorage``, ``FsspecStorage``), one
process. Store A (S3) and B (the local disk) take turns; MB/s is the checkpoint's bytes over
the median time of a full save (stage, write, commit) or load. The S3 server runs in this
process, so its time competes with the client's: the numbers say what the code path costs on
loopback, not what a real object store does over a network.

    python bench/checkpoint_store.py                   # the debug model, 5 rounds
    python bench/checkpoint_store.py --params 300e6    # a ~300M model too
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import benchlib
import torch
import torch.distributed.checkpoint as dcp


def model_params(flavor: str) -> int:
    from plugtrain.model.llama.args import run_model_args

    return run_model_args(flavor, 50257, 256).num_params()


def state_of(params: int) -> dict[str, torch.Tensor]:
    """A checkpoint-like state of ``params`` parameters: weights and two AdamW moments, in
    tensors of at most 4M elements (a model's matrices)."""
    chunk = 4 * 2**20
    sizes = [chunk] * (params // chunk) + ([params % chunk] if params % chunk else [])
    gen = torch.Generator().manual_seed(0)
    return {
        f"{part}.{i}": torch.rand(n, generator=gen)
        for part in ("model", "exp_avg", "exp_avg_sq")
        for i, n in enumerate(sizes)
    }


def one_round(storage: Any, step: int, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Seconds to save ``state`` as checkpoint ``step`` of ``storage``, then to load it."""
    start = time.perf_counter()
    storage.stage(step, {})
    dcp.save(state, storage_writer=storage.writer(step), no_dist=True)
    storage.commit(step)
    saved = time.perf_counter() - start
    target = {k: torch.empty_like(v) for k, v in state.items()}
    start = time.perf_counter()
    dcp.load(target, storage_reader=storage.reader(step), no_dist=True)
    loaded = time.perf_counter() - start
    assert all(torch.equal(target[k], v) for k, v in state.items())
    storage.delete(step)
    return saved, loaded


def add_arguments(parser: Any) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="default: %(default)s")
    parser.add_argument(
        "--params", type=float, default=0, help="also a model of this many parameters (300e6)"
    )


def main() -> None:
    args = benchlib.parse_args("checkpoint_store", __doc__.splitlines()[0], add_arguments)
    if args.quick:
        args.rounds = 1
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    from plugtrain.checkpoint.object_store import FsspecStorage
    from plugtrain.checkpoint.storage import LocalStorage
    from plugtrain.testing import S3Server

    models = [("debug", model_params("debug"))]
    if args.params:
        models.append((f"{args.params / 1e6:.0f}M", int(args.params)))
    rows, results = [], []
    with S3Server() as server, server.environ(), tempfile.TemporaryDirectory() as tmp:
        stores = {
            "s3 (moto, loopback)": FsspecStorage(server.url("bench"), server.endpoint),
            "local disk": LocalStorage(Path(tmp) / "checkpoints"),
        }
        # moto joins a multipart upload's parts in Python while the completing request waits:
        # over botocore's 60 s read timeout for a GB-sized shard on a loaded machine.
        stores["s3 (moto, loopback)"].fs.config_kwargs["read_timeout"] = 900
        for name, params in models:
            state = state_of(params)
            mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
            times: dict[str, list[tuple[float, float]]] = {s: [] for s in stores}
            for i, which in enumerate(benchlib.rounds(args.rounds, len(stores))):
                store = list(stores)[which]
                times[store].append(one_round(stores[store], i + 1, state))
            local = times["local disk"]
            for store, pairs in times.items():
                save_s = statistics.median(p[0] for p in pairs)
                load_s = statistics.median(p[1] for p in pairs)
                pairs_vs_local = list(zip(pairs, local, strict=True))
                ratio_save = statistics.median(a[0] / b[0] for a, b in pairs_vs_local)
                ratio_load = statistics.median(a[1] / b[1] for a, b in pairs_vs_local)
                rows.append([name, f"{mb:.0f}", store, mb / save_s, mb / load_s,
                             ratio_save, ratio_load])  # fmt: skip
                results.append({
                    "model": name, "params": params, "megabytes": mb, "store": store,
                    "save_s": benchlib.summary([p[0] for p in pairs]),
                    "load_s": benchlib.summary([p[1] for p in pairs]),
                    "save_time_vs_local": ratio_save, "load_time_vs_local": ratio_load,
                })  # fmt: skip
    print(benchlib.table(
        ["model", "MB", "store", "save MB/s", "load MB/s", "save time / local",
         "load time / local"], rows))  # fmt: skip
    benchlib.write_json(args.out, "checkpoint_store", args, results)


if __name__ == "__main__":
    main()
