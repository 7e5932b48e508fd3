"""Fixtures of the GPU tests (``pytest -m gpu``): the device, and what stands in for CUDA's tools.

Every test here is marked ``gpu`` and runs on ``cuda:0``; without CUDA it is skipped, saying
why. ``PLUGTRAIN_GPU_TESTS_ON_CPU=1`` runs the same bodies on the CPU instead (what CUDA alone
can check is then left out: sync debug mode, events, the profiler's copy kinds,
``max_memory_allocated``), to shake a test out before a GPU is at hand.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch

from plugtrain.observability.costs import CostCounter

ON_CPU = os.environ.get("PLUGTRAIN_GPU_TESTS_ON_CPU") == "1"
"""The hidden switch: the GPU tests' bodies on the CPU."""

# cuBLAS picks its workspace per stream and may then sum in a different order from run to
# run; this setting (read when cuBLAS starts) makes it deterministic, as the bitwise tests need.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder is a ``gpu`` test (``pytest -m gpu`` selects them), skipped
    without CUDA before any fixture is set up."""
    usable = ON_CPU or torch.cuda.is_available()
    built = torch.version.cuda or "a CPU-only build"
    reason = f"needs a CUDA device (torch {torch.__version__}, {built})"
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.skipif(not usable, reason=reason))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda:0``, or the CPU under the hidden switch."""
    return torch.device("cpu") if ON_CPU else torch.device("cuda", 0)


@pytest.fixture(scope="session")
def device_args(device: torch.device) -> tuple[str, ...]:
    """The config arguments that train on ``device``."""
    return ("--training.device", device.type)


@pytest.fixture
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for bitwise comparisons: the math attention (the flash and
    memory-efficient backward kernels may accumulate with atomics) and torch's deterministic
    algorithms (warning, not failing, where an op has none)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(previous)


class SyncGuard:
    """Host syncs forbidden while armed: on CUDA any sync raises (``set_sync_debug_mode``,
    "error"); on the CPU they are counted (:class:`CostCounter`), :meth:`check` raises if any."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counter = CostCounter()
        self.armed = False

    def arm(self) -> None:
        if not self.armed:
            self.armed = True
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            else:
                self.counter.__enter__()

    def disarm(self) -> None:
        if self.armed:
            self.armed = False
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            else:
                self.counter.__exit__(None, None, None)

    @contextmanager
    def lifted(self) -> Iterator[None]:
        """Syncs allowed for a while (a logging step's reads), then forbidden again if they
        were."""
        was_armed = self.armed
        self.disarm()
        try:
            yield
        finally:
            if was_armed:
                self.arm()

    def check(self) -> None:
        """Raise as CUDA would have, if a sync was counted on the CPU while armed."""
        if self.counter.num_syncs:
            sites = sorted(self.counter.sync_sites)
            raise RuntimeError(f"called a synchronizing operation while forbidden: {sites}")


@pytest.fixture
def sync_guard(device: torch.device) -> Iterator[SyncGuard]:
    guard = SyncGuard(device)
    try:
        yield guard
    finally:
        guard.disarm()


@pytest.fixture
def peak_bytes(device: torch.device) -> Callable[[], AbstractContextManager[dict[str, int]]]:
    """``with peak_bytes() as peak:`` then ``peak["bytes"]`` (see :func:`measure_peak`)."""
    return lambda: measure_peak(device)


@contextmanager
def measure_peak(device: torch.device) -> Iterator[dict[str, int]]:
    """The most memory that the block allocated above what was allocated when it began
    (CUDA's allocator; on the CPU the kit's :class:`PeakMemory`, which counts the tensors ops
    create)."""
    result = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["bytes"] = torch.cuda.max_memory_allocated(device) - before
    else:
        from plugtrain.testing import PeakMemory

        with PeakMemory() as memory:
            yield result
        result["bytes"] = memory.peak
