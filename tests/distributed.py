"""Run a test function on N real processes (torch.multiprocessing, gloo, loopback)."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from runs import free_port

from plugtrain.distributed import destroy_world


def _worker(rank: int, world_size: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        result: Any = ("ok", fn(*args))
        destroy_world()
    except BaseException as e:  # reported to the parent, which re-raises
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` spawned ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled) and must not swallow errors: an
    exception on any rank fails the calling test with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), out, fn, args),
            nprocs=world_size,
            start_method="spawn",
        )
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    errors = [msg for status, msg in results if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in results]
