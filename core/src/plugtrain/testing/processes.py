"""Several processes: a function on spawned ranks, a training script run as a user runs it.

Both hand the children the session's data cache (:mod:`plugtrain.testing.session`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plugtrain.testing.session import session_cache

PRELOADED = ("torch", "torch.distributed", "plugtrain.testing.runs", "plugtrain.testing.checks")
"""What :func:`run_distributed`'s fork server imports before it forks ranks: what every rank
would import (seconds of a loaded machine's time each), not transformers, which few need."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_module(name: str, file: str | None) -> None:
    """Make module ``name`` importable in this process: import it, or load it from ``file``."""
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except ImportError:
        if file is None:
            raise
    # Parents first, as empty modules, so that pickle's __import__ of the dotted name works.
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None, file
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out: str,
    module: tuple[str, str | None],
    payload: bytes,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's, not the fork server's (started by an earlier call)
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from plugtrain.distributed import destroy_world

    try:
        _load_module(*module)
        fn, args = pickle.loads(payload)
        result: Any = ("ok", fn(*args))
        destroy_world()
    except BaseException as e:  # reported to the parent, which re-raises
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        data = pickle.dumps(result)
    except Exception as e:
        data = pickle.dumps(("error", f"rank {rank}: its result cannot be pickled: {e}"))
    Path(out, f"rank{rank}.pkl").write_bytes(data)
    # Python's own exit (its modules, torch's among them, torn down one by one) takes a rank
    # 1-3 s on a loaded machine, each launch of the suite over; nothing is left to keep.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` spawned ranks; return each rank's result, by rank.

    The ranks fork from a server that imported :data:`PRELOADED` once for the calling process;
    they inherit no other state of the caller's but its folder, environment and ``sys.path``,
    as of the call. Each rank has ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set (loopback, a free port), so a trainer built inside joins the others
    over gloo. ``fn`` must be a
    module-level function (it is pickled, as are ``args`` and the results) and must not
    swallow errors: an exception on any rank fails the caller with that rank's traceback.
    """
    import torch.multiprocessing as mp

    session_cache()  # before spawning: the ranks inherit it
    module = sys.modules[fn.__module__]
    where = (fn.__module__, getattr(module, "__file__", None))
    payload = pickle.dumps((fn, args))
    # Each rank forks from the server instead of starting a Python that imports torch: 5-8 s
    # a launch of 2 ranks on a loaded machine, 0.1 s once the server runs.
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), out, where, payload, dict(os.environ)),
            nprocs=world_size,
            start_method="forkserver",
        )
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    errors = [message for status, message in results if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in results]


def run_script(
    script: str | Path,
    args: Sequence[str],
    nproc: int = 1,
    timeout: float = 300,
    *,
    env: dict[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Run a training script (``train.py``) as a user would: python for 1 process, torchrun
    for more; return its exit status and output.

    ``env`` adds environment variables; ``torchrun_args`` (``--max-restarts=1``) go to
    torchrun, which then runs even for one process. On a timeout it stops the run (SIGTERM,
    which torchrun passes on to its workers, then SIGKILL a minute later) and raises.
    """
    if nproc == 1 and not torchrun_args:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            *torchrun_args, str(script), *args,
        ]  # fmt: skip
    session_cache()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: SIGKILL would leave torchrun's workers running, or hanging.
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
