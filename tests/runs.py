"""Helpers to configure and run small training jobs from tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VALIDATION = REPO / "data" / "shakespeare" / "validation.jsonl"


def tiny_args(dump_folder: Path, *extra: str, steps: int = 3) -> list[str]:
    """Arguments for a run of the tiny model that takes about a second.

    It trains on the (small) validation split to keep tokenisation fast, with validation off.
    """
    return [
        "--job.dump_folder", str(dump_folder),
        "--model.flavor", "tiny",
        "--model.tokenizer_path", str(REPO / "data" / "shakespeare" / "tokenizer.json"),
        "--data.train_path", str(VALIDATION),
        "--training.steps", str(steps),
        "--training.batch_size", "4",
        "--training.seq_len", "32",
        "--lr_scheduler.warmup_steps", "1",
        "--validation.interval", "0",
        "--metrics.log_freq", "1",
        *extra,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train_py(
    args: list[str],
    nproc: int = 1,
    timeout: float = 300,
    *,
    env: dict[str, str] | None = None,
    torchrun_args: tuple[str, ...] = (),
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """Run ``train.py`` as a user would: plain python for 1 process, torchrun for more.

    ``env`` adds environment variables; ``torchrun_args`` (e.g. ``--max-restarts=1``) go to
    torchrun, which then runs even for one process. ``cwd`` is the folder it is started from.
    """
    if nproc == 1 and not torchrun_args:
        cmd = [sys.executable, str(REPO / "train.py"), *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            *torchrun_args, str(REPO / "train.py"), *args,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun passes it on to its workers (SIGKILL would leave them
            # running, or hanging, on a machine other tests share), and kills them 30 s later.
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
