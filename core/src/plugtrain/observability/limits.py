"""The limits MFU is measured against: a GPU's peak, and the matmul limit, timed and cached.

A GPU's peak is its data sheet's dense TFLOP/s in the step's compute precision
(:data:`PEAK_TFLOPS`): an upper bound no step reaches. The matmul limit, measured beside it on
a GPU and in its place on a CPU (which has no peak to speak of), is the time torch's own
``mm``/``bmm`` take for the GEMMs of a step (``ModelSpec.gemms``), each distinct shape timed
alone: no step making those products can take much less. One reading on a shared machine can
be slowed by its neighbours, never sped up, so the limit keeps the fastest time seen: each
shape is timed in turns with the others (a burst of load then slows one reading of each, not
every reading of one), :data:`ROUNDS` times after an untimed round, and its fastest time is
cached per machine and shape in ``<cache>/matmul_limits.json`` (``$PLUGTRAIN_CACHE``, default
``$XDG_CACHE_HOME/plugtrain``, else ``~/.cache/plugtrain``). A run whose shapes are all cached
times nothing; a new reading only ever lowers a cached time. The machine is the CPU model and
core count with torch's intra-op threads (or the GPU's name and whether fp32 runs as TF32),
torch's version and the dtype.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from plugtrain.data import cache_root
from plugtrain.model import Gemm

logger = logging.getLogger("plugtrain")

Shape = tuple[int, int, int, int]
"""A GEMM's ``(batch, m, n, k)``: ``batch`` products of ``(m, k)`` by ``(k, n)``."""
ROUNDS = 3
"""Timed rounds of a start-up timing, each shape once a round, after one untimed round."""
CACHE_FILE = "matmul_limits.json"
RETIME_SHARE = 0.01
"""A step that beats the limit has it re-timed, at most once per this share of the run's time:
a re-timing may cost this share of the time since the previous timing, no more."""


# Dense (no sparsity) peaks in TFLOP/s per GPU, from NVIDIA's data sheets (which give most
# tensor-core figures with sparsity: twice these), by compute precision: bf16 and fp16 tensor
# cores, tf32 tensor cores (fp32 GEMMs where torch allows TF32), fp32 without. Matched,
# ignoring case, against torch.cuda.get_device_name; the first match wins.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GB200", {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),  # HGX B200
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # SXM, GH200
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM and PCIe
)


def gpu_precision(dtype: torch.dtype) -> str:
    """The row of :data:`PEAK_TFLOPS` a CUDA GEMM in ``dtype`` runs at: ``bf16``, ``fp16``,
    ``tf32`` (float32 where torch allows TF32) or ``fp32``."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    # The setting both of torch's TF32 switches set (and read without mixing them).
    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


def table_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of the GPU named ``device_name`` at ``precision`` (a key of
    :data:`PEAK_TFLOPS`' rows), or None for a GPU the table does not know."""
    name = device_name.casefold()
    row = next((peaks for key, peaks in PEAK_TFLOPS if key.casefold() in name), None)
    return row[precision] if row else None


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float | None:
    """The device's peak TFLOP/s for MFU of GEMMs in ``dtype``: ``override`` if > 0, the
    table's entry for a known GPU, else None (CPU, or an unknown GPU: MFU is then omitted
    rather than invented)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name, precision = torch.cuda.get_device_name(device), gpu_precision(dtype)
    peak = table_peak_tflops(name, precision)
    if peak is None:
        logger.warning(
            "MFU is not reported: no %s peak TFLOP/s known for GPU '%s'; set metrics.peak_tflops",
            precision,
            name,
        )
    return peak


def shape_counts(gemms: Iterable[Gemm]) -> dict[Shape, int]:
    """How many products of each distinct shape ``gemms`` stand for."""
    counts: dict[Shape, int] = {}
    for g in gemms:
        shape = (g.batch, g.m, g.n, g.k)
        counts[shape] = counts.get(shape, 0) + g.count
    return counts


def time_shapes(
    shapes: Sequence[Shape], device: torch.device, dtype: torch.dtype, rounds: int = ROUNDS
) -> dict[Shape, float]:
    """The fastest seconds of torch's ``mm`` (``bmm`` for a batch) at each of ``shapes`` on
    ``device`` in ``dtype``, over ``rounds`` rounds that time each shape once, in turns, after
    an untimed round that warms up the kernel choice and the allocator.

    The operands are constants (values do not change a GEMM's time, barring denormals) so that
    no random stream is drawn from; each round makes them afresh, so that only one shape's
    operands are alive at a time. On CUDA each timing synchronises: call it outside the step.
    """
    best = dict.fromkeys(shapes, math.inf)
    for timed_round in range(rounds + 1):
        for shape in shapes:
            batch, m, n, k = shape
            lead = () if batch == 1 else (batch,)
            a = torch.full((*lead, m, k), 0.5, device=device, dtype=dtype)
            b = torch.full((*lead, k, n), 0.5, device=device, dtype=dtype)
            product = torch.mm if batch == 1 else torch.bmm
            _synchronize(device)
            start = time.perf_counter()
            product(a, b)
            _synchronize(device)
            seconds = time.perf_counter() - start
            if timed_round:
                best[shape] = min(best[shape], seconds)
            del a, b
    return best


def matmul_seconds(
    gemms: Sequence[Gemm], device: torch.device, dtype: torch.dtype, repeats: int = ROUNDS
) -> float:
    """Seconds torch's matmuls take for ``gemms`` on ``device`` in ``dtype``: each distinct
    shape's fastest time over ``repeats`` rounds (:func:`time_shapes`), times its count. Not
    cached: the benchmarks time it afresh."""
    counts = shape_counts(gemms)
    best = time_shapes(list(counts), device, dtype, repeats)
    return sum(count * best[shape] for shape, count in counts.items())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a cached time holds for: the GPU's name and precision (TF32 or not), or the CPU's
    model, cores and torch's threads; torch's version; ``dtype``."""
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)} ({gpu_precision(dtype)})"
    else:
        machine = f"{_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return f"{machine}; torch {torch.__version__}; {dtype}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass  # not Linux
    return platform.processor() or platform.machine()


def _shape_key(shape: Shape) -> str:
    return "x".join(map(str, shape))


class LimitCache:
    """The fastest seconds of each GEMM shape seen on each machine, in a JSON file:
    ``{machine key: {"BxMxNxK": seconds}}``. An unreadable file counts as empty; one that
    cannot be written leaves the limit uncached, with a warning."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_root() / CACHE_FILE

    def _read(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, machine: str, shapes: Iterable[Shape]) -> dict[Shape, float]:
        """The cached seconds of those of ``shapes`` this machine has timed."""
        known = self._read().get(machine, {})
        found = {shape: known.get(_shape_key(shape)) for shape in shapes}
        return {s: float(t) for s, t in found.items() if isinstance(t, int | float) and t > 0}

    def update(self, machine: str, seconds: Mapping[Shape, float]) -> None:
        """Keep ``seconds`` where they beat (or fill in) this machine's cached times; the file
        is replaced whole, so that a reader never sees half of it."""
        data = self._read()
        known = data.setdefault(machine, {})
        if not isinstance(known, dict):
            known = data[machine] = {}
        for shape, t in seconds.items():
            key = _shape_key(shape)
            old = known.get(key)
            known[key] = min(t, old) if isinstance(old, int | float) and old > 0 else t
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, prefix=f".{self.path.name}.", delete=False
            ) as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(f.name, self.path)
        except OSError as e:
            logger.warning("the matmul limit is not cached: cannot write %s (%s)", self.path, e)


class MatmulLimit:
    """The matmul limit of a step of ``scale`` times ``gemms`` (its microbatches' products) on
    ``device`` in ``dtype``: from the cache where it holds every shape, else timed (the missing
    shapes, :data:`ROUNDS` rounds) and cached; re-timed when a step beats it
    (:meth:`against`)."""

    def __init__(
        self,
        gemms: Sequence[Gemm],
        device: torch.device,
        dtype: torch.dtype,
        *,
        scale: int = 1,
        cache: LimitCache | None = None,
    ) -> None:
        self.device, self.dtype, self.scale = device, dtype, scale
        self.counts = shape_counts(gemms)
        self.cache = cache or LimitCache()
        self.machine = machine_key(device, dtype)
        self.best = self.cache.get(self.machine, self.counts)
        self.timed_at = time.monotonic()
        missing = [shape for shape in self.counts if shape not in self.best]
        if missing:
            took = self._time(missing)
            logger.info(
                "matmul limit: %d GEMM shapes timed in %.1f s (cached in %s)",
                len(missing),
                took,
                self.cache.path,
            )

    @property
    def seconds(self) -> float:
        """Seconds the step's GEMMs alone take: no step making them can take less."""
        return self.scale * sum(n * self.best[shape] for shape, n in self.counts.items())

    def against(self, step_seconds: float) -> float:
        """:attr:`seconds`, re-timed first when a step of ``step_seconds`` beat it (a timing
        slowed by other jobs), unless the last timing is too recent (:data:`RETIME_SHARE`)."""
        before = self.seconds
        # Each round times every shape once: the cost of a timing, from the limit itself.
        cost = (ROUNDS + 1) * sum(self.best.values())
        if step_seconds < before and time.monotonic() - self.timed_at >= cost / RETIME_SHARE:
            try:
                took = self._time(list(self.counts))
            except torch.OutOfMemoryError:  # on a GPU the step left too little: keep the limit
                self.timed_at = time.monotonic()
                return before
            logger.info(
                "a step (%.1f ms) beat the matmul limit (%.1f ms): re-timed in %.1f s, %.1f ms",
                step_seconds * 1e3,
                before * 1e3,
                took,
                self.seconds * 1e3,
            )
        return self.seconds

    def _time(self, shapes: Sequence[Shape]) -> float:
        """Time ``shapes``, keep each one's faster of the new and the known time, cache them;
        the seconds it took."""
        start = time.perf_counter()
        timed = time_shapes(shapes, self.device, self.dtype)
        for shape, t in timed.items():
            self.best[shape] = min(t, self.best.get(shape, math.inf))
        self.cache.update(self.machine, timed)
        self.timed_at = time.monotonic()
        return time.perf_counter() - start
