"""The limits MFU is measured against: a GPU's peak from the table; the matmul limit, timed in
turns, fastest round, cached per machine, re-timed when a step beats it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from plugtrain.model import Gemm
from plugtrain.observability import limits
from plugtrain.observability.limits import (
    LimitCache,
    MatmulLimit,
    gpu_precision,
    machine_key,
    matmul_seconds,
    peak_tflops,
    table_peak_tflops,
    time_shapes,
)

CPU = torch.device("cpu")
GEMMS = [Gemm("a", 8, 4, 2, count=3), Gemm("b", 8, 4, 2), Gemm("c", 4, 8, 2)]
SHAPES = [(1, 8, 4, 2), (1, 4, 8, 2)]  # GEMMS' distinct shapes: the first stands for 4 products


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """The messages the ``plugtrain`` logger warns during the test, as they come: caught on
    the logger itself, since a run earlier in the process stops it propagating to the root."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("plugtrain")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> LimitCache:
    """The limit's cache in ``tmp_path``, never the user's: ``PLUGTRAIN_CACHE`` points there."""
    monkeypatch.setenv("PLUGTRAIN_CACHE", str(tmp_path))
    return LimitCache()


@pytest.fixture
def timings(monkeypatch) -> list[list]:
    """Replaces the timing: each shape takes 1 ms per unit of ``m``; returns the shapes of
    each call."""
    calls = []

    def fake(shapes, device, dtype, rounds=limits.ROUNDS):
        calls.append(list(shapes))
        return {shape: shape[1] * 1e-3 for shape in shapes}

    monkeypatch.setattr(limits, "time_shapes", fake)
    return calls


def test_shapes_are_timed_in_turns_and_draw_no_random_numbers(monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append((a.shape, b.shape)) or real_mm(a, b))
    state = torch.get_rng_state()
    seconds = matmul_seconds(GEMMS, CPU, torch.float32, repeats=2)
    assert torch.equal(torch.get_rng_state(), state)
    # An untimed round, then two timed ones, each shape once a round.
    assert calls == [((8, 2), (2, 4)), ((4, 2), (2, 8))] * 3
    assert seconds > 0


def test_each_shape_keeps_its_fastest_timed_round(monkeypatch):
    # Seconds of each call, round by round: (first shape, second shape); the untimed first
    # round is the fastest of all, and does not count.
    rounds = [(0.01, 0.02), (0.5, 0.9), (0.2, 0.6), (0.3, 0.4)]
    clock = iter([t for r in rounds for took in r for t in (0.0, took)])
    monkeypatch.setattr(limits.time, "perf_counter", lambda: next(clock))
    assert time_shapes(SHAPES, CPU, torch.float32, rounds=3) == {SHAPES[0]: 0.2, SHAPES[1]: 0.4}
    clock = iter([t for r in rounds for took in r for t in (0.0, took)])
    assert matmul_seconds(GEMMS, CPU, torch.float32, repeats=3) == pytest.approx(4 * 0.2 + 0.4)


def test_a_cached_limit_times_nothing(cache, timings):
    first = MatmulLimit(GEMMS, CPU, torch.float32, scale=2)
    assert timings == [SHAPES]
    assert first.seconds == pytest.approx(2 * (4 * 8e-3 + 4e-3))  # 2 microbatches a step
    stored = json.loads(cache.path.read_text())
    assert stored == {machine_key(CPU, torch.float32): {"1x8x4x2": 8e-3, "1x4x8x2": 4e-3}}
    again = MatmulLimit(GEMMS, CPU, torch.float32, scale=2)
    assert timings == [SHAPES] and again.seconds == first.seconds
    # Another step's shapes: only the new one is timed.
    MatmulLimit([*GEMMS, Gemm("d", 16, 2, 2, batch=3)], CPU, torch.float32)
    assert timings == [SHAPES, [(3, 16, 2, 2)]]


@pytest.mark.parametrize("change", ["threads", "cores", "cpu", "torch", "dtype"])
def test_another_machine_times_again(cache, timings, monkeypatch, change):
    MatmulLimit(GEMMS, CPU, torch.float32)
    dtype = torch.float32
    if change == "threads":
        threads = torch.get_num_threads() + 1
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    elif change == "cores":
        monkeypatch.setattr(limits.os, "cpu_count", lambda: 1024)
    elif change == "cpu":
        monkeypatch.setattr(limits, "_cpu_model", lambda: "another CPU")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    else:
        dtype = torch.bfloat16
    MatmulLimit(GEMMS, CPU, dtype)
    assert timings == [SHAPES, SHAPES]
    assert len(json.loads(cache.path.read_text())) == 2  # each machine's times kept


def test_a_new_reading_only_lowers_a_cached_time(cache):
    machine = machine_key(CPU, torch.float32)
    cache.update(machine, {SHAPES[0]: 0.2, SHAPES[1]: 0.4})
    cache.update(machine, {SHAPES[0]: 0.3, SHAPES[1]: 0.1})
    assert cache.get(machine, SHAPES) == {SHAPES[0]: 0.2, SHAPES[1]: 0.1}
    assert cache.get(machine, [(1, 2, 3, 4)]) == {}
    assert cache.get("another machine", SHAPES) == {}


def test_an_unreadable_cache_counts_as_empty_and_an_unwritable_one_warns(
    cache, timings, tmp_path, warnings_logged
):
    cache.path.write_text("{not json")
    assert cache.get(machine_key(CPU, torch.float32), SHAPES) == {}
    limit = MatmulLimit(GEMMS, CPU, torch.float32)  # rewrites it
    assert cache.get(limit.machine, SHAPES) == limit.best
    (tmp_path / "file").write_text("")
    blocked = MatmulLimit(GEMMS, CPU, torch.float32, cache=LimitCache(tmp_path / "file" / "x"))
    assert blocked.seconds == limit.seconds  # timed all the same
    assert warnings_logged == [
        f"the matmul limit is not cached: cannot write {tmp_path / 'file' / 'x'} "
        f"([Errno 17] File exists: '{tmp_path / 'file'}')"
    ]


def test_the_limit_is_timed_for_real_then_read_from_the_cache(cache, monkeypatch):
    limit = MatmulLimit(GEMMS, CPU, torch.float32)
    assert set(limit.best) == set(SHAPES) and all(t > 0 for t in limit.best.values())
    monkeypatch.setattr(limits, "time_shapes", None)  # a second timing would fail
    assert MatmulLimit(GEMMS, CPU, torch.float32).seconds == limit.seconds


def test_a_step_that_beats_the_limit_has_it_retimed_at_most_so_often(cache, monkeypatch):
    readings = iter([{shape: 1.0 for shape in SHAPES}, {shape: 0.01 for shape in SHAPES}])
    monkeypatch.setattr(limits, "time_shapes", lambda shapes, device, dtype: next(readings))
    now = [0.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    limit = MatmulLimit(GEMMS, CPU, torch.float32)  # slowed by other jobs: 5 s
    assert limit.seconds == 5.0
    assert limit.against(6.0) == 5.0  # not beaten: nothing timed
    # A timing costs 4 rounds of 2 s: the next may come 800 s after this one, not before.
    now[0] = 799.0
    assert limit.against(1.0) == 5.0
    now[0] = 800.0
    assert limit.against(1.0) == pytest.approx(0.05)
    assert cache.get(limit.machine, SHAPES) == {shape: 0.01 for shape in SHAPES}
    assert limit.against(0.01) == pytest.approx(0.05)  # beaten again, too soon to re-time


@pytest.mark.parametrize(
    ("name", "bf16", "tf32", "fp32"),
    [  # torch.cuda.get_device_name's names
        ("NVIDIA H100 80GB HBM3", 989.5, 494.5, 67.0),
        ("NVIDIA H100 PCIe", 756.5, 378.0, 51.0),
        ("NVIDIA H100 NVL", 835.5, 417.5, 60.0),
        ("NVIDIA H200", 989.5, 494.5, 67.0),
        ("NVIDIA H200 NVL", 835.5, 417.5, 60.0),
        ("NVIDIA GH200 480GB", 989.5, 494.5, 67.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 156.0, 19.5),
        ("NVIDIA A100-PCIE-40GB", 312.0, 156.0, 19.5),
        ("NVIDIA B200", 2250.0, 1100.0, 75.0),
        ("NVIDIA GB200", 2500.0, 1250.0, 80.0),
    ],
)
def test_the_peak_table_gives_each_gpu_its_dense_peak_per_precision(name, bf16, tf32, fp32):
    peaks = {p: table_peak_tflops(name, p) for p in ("bf16", "fp16", "tf32", "fp32")}
    assert peaks == {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32}


def test_an_unknown_gpu_has_no_peak_and_says_so(monkeypatch, warnings_logged):
    assert table_peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    assert peak_tflops(torch.device("cuda", 0), torch.float16) is None
    assert warnings_logged == [
        "MFU is not reported: no fp16 peak TFLOP/s known for GPU 'NVIDIA L4'; "
        "set metrics.peak_tflops"
    ]
    assert peak_tflops(torch.device("cuda", 0), torch.float16, override=100.0) == 100.0


def test_the_run_looks_its_gpu_up_in_its_compute_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cuda = torch.device("cuda", 0)
    assert peak_tflops(cuda, torch.bfloat16) == 756.5
    assert peak_tflops(cuda, torch.float32) == 51.0
    assert gpu_precision(torch.float32) == "fp32"
    # As torch.backends.cuda.matmul.fp32_precision = "tf32" does, without setting it for the
    # rest of the session (where torch's older switch would then refuse to be read).
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision="tf32"))
    assert peak_tflops(cuda, torch.float32) == 378.0
    assert machine_key(cuda, torch.float32).startswith("NVIDIA H100 PCIe (tf32); torch ")
    assert peak_tflops(torch.device("cpu"), torch.float32) is None  # no peak: mfu(mm) only


def test_a_retiming_that_runs_out_of_memory_keeps_the_limit(cache, timings, monkeypatch):
    limit = MatmulLimit(GEMMS, CPU, torch.float32)
    tries = []

    def out_of_memory(shapes, device, dtype):
        tries.append(shapes)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(limits, "time_shapes", out_of_memory)
    monkeypatch.setattr(limits.time, "monotonic", lambda: 1e6)  # long after the first timing
    assert limit.against(1e-6) == limit.seconds == pytest.approx(4 * 8e-3 + 4e-3)
    assert limit.against(1e-6) == limit.seconds  # counts as a timing: not tried again at once
    assert len(tries) == 1
