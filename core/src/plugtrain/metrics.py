"""Step metrics: a console line and a JSONL record per logged step, on rank 0."""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("plugtrain")


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or the CPU's max resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # NOTE: ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def to_number(value: Any) -> float:
    """A metric value as a Python float (reads a tensor: a device sync on GPU)."""
    if isinstance(value, torch.Tensor):
        full_tensor = getattr(value, "full_tensor", None)
        value = (full_tensor() if full_tensor else value).item()
    return float(value)


class MetricsLogger:
    """Writes each logged step to ``<dump_folder>/metrics.jsonl`` and the console (rank 0)."""

    def __init__(self, dump_folder: str, *, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(dump_folder) / "metrics.jsonl"
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")

    def log(self, record: Mapping[str, Any]) -> None:
        """Record one step's metrics; ``record`` holds ``step`` and plain numbers."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        logger.info(format_line(record))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def format_line(record: Mapping[str, Any]) -> str:
    """A compact console line: ``step 10 | loss 5.1234 | lr 3.0e-03 | ...``."""
    parts = [f"step {record['step']:>5}"]
    for key, value in record.items():
        if key == "step":
            continue
        short = key.rsplit("/", 1)[-1]
        if isinstance(value, bool) or value is None:
            parts.append(f"{short} {value}")
        elif isinstance(value, int) or (
            isinstance(value, float) and value.is_integer() and abs(value) >= 1e4
        ):
            parts.append(f"{short} {int(value):,}")
        elif isinstance(value, float) and (
            value == 0 or 1e-3 <= abs(value) < 1e4 or not math.isfinite(value)
        ):
            parts.append(f"{short} {value:.4f}")
        else:
            parts.append(f"{short} {value:.2e}")
    return " | ".join(parts)


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO to stderr; other ranks log warnings and errors only."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = "" if rank == 0 else f"[rank{rank}] "
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
