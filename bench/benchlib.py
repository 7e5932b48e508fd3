"""What every benchmark in ``bench/`` shares: arguments, statistics, tables, JSON (processes:
the test kit's ``plugtrain.testing.run_distributed``).

Each benchmark is a script (``python bench/<name>.py``) that prints a table and writes its
results as JSON (``outputs/bench/<name>.json`` unless ``--out`` says otherwise). Comparisons are
ratios measured in one process, A and B taking turns (A B, B A, A B, ..., so that a slow drift
of the machine's speed hits both alike), over many repetitions: the median and the spread are
reported, never a single run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from plugtrain import sample

REPO = Path(__file__).resolve().parents[1]
DATA = sample.FOLDER
_LOAD_AT_START = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
"""The machine's load averages (1, 5, 15 minutes) when the benchmark started."""


def parse_args(
    name: str, description: str, add: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The command line every benchmark takes (``--quick``, ``--out``, ``--threads``) plus its own.

    Sets torch's intra-op thread count to ``--threads`` before anything runs: on a shared
    machine an explicit, small thread count gives steadier timings than torch's default.
    """
    parser = argparse.ArgumentParser(prog=f"bench/{name}.py", description=description)
    parser.add_argument(
        "--quick", action="store_true", help="a few repetitions only: checks that it runs"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "outputs" / "bench" / f"{name}.json",
        help="where to write the JSON results (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)"
    )
    if add is not None:
        add(parser)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    return args


def machine() -> dict[str, Any]:
    """The machine and software a result was measured on, recorded with every result."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": _LOAD_AT_START,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


# --------------------------------------------------------------------------- statistics


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median and spread of ``values``: quartiles, min, max, count."""
    if not values:
        raise ValueError("summary() of no values")
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {
        "median": statistics.median(ordered),
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def median_ci(values: Sequence[float], level: float = 0.95, resamples: int = 2000) -> list[float]:
    """A bootstrap confidence interval of the median of ``values`` (seeded: reproducible)."""
    rng = random.Random(0)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = medians[int((1 - level) / 2 * resamples)]
    hi = medians[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return [lo, hi]


def rounds(n_rounds: int, n_contestants: int) -> list[int]:
    """The order of ``n_rounds`` rounds in which each contestant runs once: forward, then
    backward (A B C, C B A, A B C, ...), so that no contestant always follows another."""
    forward = list(range(n_contestants))
    return [i for r in range(n_rounds) for i in (forward if r % 2 == 0 else forward[::-1])]


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Compare times ``a`` and ``b`` measured in alternation (``a[i]`` next to ``b[i]``).

    Each pair gives a ratio ``a[i] / b[i]``; the median of those ratios, its bootstrap 95%
    confidence interval and their quartiles are the result. NOTE: the ratio of each pair, not
    the ratio of two overall medians, because neighbouring steps share the machine's load of
    the moment, which cancels in their ratio.
    """
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "ratio": summary(ratios),
        "ratio_ci95": median_ci(ratios),
        "a_seconds": summary(a),
        "b_seconds": summary(b),
        "ratio_of_medians": statistics.median(a) / statistics.median(b),
    }


# --------------------------------------------------------------------------- output


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable as is in a terminal, pasted as is into the docs)."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def write_json(path: Path, name: str, args: argparse.Namespace, results: Any) -> None:
    """Write ``results`` with the command line and the machine they were measured on."""
    record = {
        "benchmark": name,
        "command": " ".join([f"python bench/{name}.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")


# --------------------------------------------------------------------------- runs


def trainer_args(
    flavor: str, dtype: str, *extra: str, batch_size: int = 8, seq_len: int = 128
) -> list[str]:
    """``train.py`` arguments for a benchmark run: no validation, no logging, no final
    checkpoint, small data file.

    NOTE: trains on the validation split, which tokenises in a fraction of the training
    split's time; the benchmarks measure steps, not what the data says.
    """
    return [
        "--job.dump_folder", str(REPO / "outputs" / "bench" / "run"),
        "--model.flavor", flavor,
        "--model.tokenizer_path", str(DATA / "tokenizer.json"),
        "--data.train_path", str(DATA / "validation.jsonl"),
        "--training.batch_size", str(batch_size),
        "--training.seq_len", str(seq_len),
        "--training.mixed_precision_param", dtype,
        "--validation.interval", "0",
        "--checkpoint.save_final", "false",
        *extra,
    ]  # fmt: skip
