"""Performance of the step: phase timing, throughput, MFU and peak memory.

MFU is measured against a GPU's peak and against the matmul limit: torch's own matmuls timed at
the step's shapes (both in :mod:`plugtrain.observability.limits`).
"""

from __future__ import annotations

import logging
import resource
import time

import torch

logger = logging.getLogger("plugtrain")


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or the CPU's max resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepTimer:
    """Wall-clock time of each phase of the training step, summed over a logging window.

    The trainer calls :meth:`start_step`, then :meth:`lap` at the end of each phase: the time
    since the previous lap is added to that phase. Laps are ``time.perf_counter`` readings and
    never synchronise the device. On CPU they are exact. On CUDA they are host times: a phase
    that waits for the GPU (a ``.item()``, a full launch queue) absorbs that wait, so the split
    is indicative; the total is exact over each window, because :meth:`window` synchronises the
    device once, at the logging step, and counts that wait in the step's last phase.
    """

    PHASES = ("data", "fwd_bwd", "hooks", "optimizer")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seconds = dict.fromkeys(self.PHASES, 0.0)
        self._steps = 0
        self._last = 0.0
        self._phase = self.PHASES[-1]

    def start_step(self) -> None:
        """Start timing a step (time between steps, logging and validation, is not counted)."""
        self._steps += 1
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Count the time since the previous lap (or :meth:`start_step`) in ``phase``."""
        now = time.perf_counter()
        self._seconds[phase] += now - self._last
        self._last, self._phase = now, phase

    def window(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the previous window; starts a new one.

        Returns ``time_step_s`` and ``time_<phase>_s`` for each phase.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.lap(self._phase)
        steps = max(self._steps, 1)
        times = {f"time_{p}_s": s / steps for p, s in self._seconds.items()}
        times = {"time_step_s": sum(times.values()), **times}
        self._seconds = dict.fromkeys(self.PHASES, 0.0)
        self._steps = 0
        return times


def throughput(
    tokens_per_step: int,
    step_seconds: float,
    world_size: int,
    flops_per_token: int,
    peak: float | None,
    matmul_step_seconds: float | None = None,
) -> dict[str, float | bool]:
    """Tokens per second (global and per rank), achieved TFLOP/s per rank, MFU in percent of
    ``peak`` TFLOP/s, and in percent of the matmul limit: ``matmul_step_seconds`` (a step's
    GEMMs alone, :class:`~plugtrain.observability.limits.MatmulLimit`) over ``step_seconds``,
    the same as the model FLOP/s over the FLOP/s that torch's matmuls reach at the step's
    shapes. A percentage above 100 is flagged instead (``mfu_over_100``,
    ``mfu_matmul_over_100``)."""
    tokens_per_sec = tokens_per_step / step_seconds
    per_rank = tokens_per_sec / world_size
    out = {
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_rank": per_rank,
        "tflops": per_rank * flops_per_token / 1e12,
    }
    if peak:
        out |= _percent("mfu", out["tflops"] / peak)
    if matmul_step_seconds:
        out |= _percent("mfu_matmul", matmul_step_seconds / step_seconds)
    return out


def _percent(name: str, fraction: float) -> dict[str, float | bool]:
    """``<name>_pct``, a fraction of a limit in percent; above 100% the limit was none (a
    matmul limit timed while other jobs slowed it, a wrong peak), and no figure is given:
    ``<name>_over_100`` flags it."""
    if fraction > 1:
        return {f"{name}_over_100": True}
    return {f"{name}_pct": 100 * fraction}
