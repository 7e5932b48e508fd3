"""``plugtrain plot``: draw one or several runs' metrics from their ``metrics.jsonl`` files.

One panel per quantity, against the optimizer step, one color per run: loss (training solid,
validation dashed), grad_norm and loss_scale (any plugin's metric of that name), and throughput
(tokens per second over all ranks). A panel no run has data for is left out, and the others
fill the grid (up to three in a row). A log-scale panel whose values span less than a decade
is drawn on a linear scale, which labels its ticks plainly.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from plugtrain.errors import DataError, MissingFileError, UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (title, y-axis scale, lines): each line is (record key, or "/<name>" for every plugin's
# "<plugin>/<name>"; matplotlib line style; legend suffix).
PANELS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("loss", "linear", (("loss", "-", ""), ("validation_loss", "--", " (validation)"))),
    ("grad_norm", "log", (("/grad_norm", "-", ""),)),
    ("loss_scale", "log", (("/loss_scale", "-", ""),)),
    ("throughput (tokens/s, all ranks)", "linear", (("tokens_per_sec", "-", ""),)),
)


def read_run(path: str | Path) -> dict[str, dict[int, float]]:
    """Each metric of a run as ``{step: value}``, from a run folder or its ``metrics.jsonl``.

    A resumed run appends to its file, so a step can be logged twice: the last record wins.
    """
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise MissingFileError(f"no metrics file at '{file}': pass a run's dump folder")
    series: dict[str, dict[int, float]] = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"'{file}' line {n} is not a metrics record: {e}") from e
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                series.setdefault(key, {})[step] = float(value)
    if not series:
        raise DataError(f"'{file}' holds no metrics records: did the run log a step?")
    return series


def _matching(series: dict[str, dict[int, float]], key: str) -> list[str]:
    """The record keys a panel key names: itself, or every plugin's ``<plugin>/<name>``."""
    if key.startswith("/"):
        return sorted(k for k in series if k.endswith(key))
    return [key] if key in series else []


def _run_folder(path: str | Path) -> Path:
    """The run folder of a path given to ``plot``: the folder, or its metrics file's folder."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def _labels(paths: Sequence[str | Path]) -> list[str]:
    """Short run names: the run folders' names, or the paths as given when two names clash."""
    names = [_run_folder(p).resolve().name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def plot_runs(runs: Sequence[str | Path], output: str | Path | None = None) -> Path:
    """Draw the runs' metrics into the image ``output`` (format from its suffix, e.g. .png;
    default: ``metrics.png`` in the first run's folder) and return its path."""
    fig = draw_runs(runs)
    output = _run_folder(runs[0]) / "metrics.png" if output is None else Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    return output


def draw_runs(runs: Sequence[str | Path]) -> Figure:
    """The figure of the runs' metrics: one panel per quantity that some run has."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(
            "plugtrain plot needs the 'matplotlib' package, which is not installed: "
            "pip install 'plugtrain[plot]'"
        )
    # A bare Figure renders through Agg without pyplot: no GUI backend, no global state.
    from matplotlib.figure import Figure

    data = [read_run(run) for run in runs]
    panels = [
        (title, scale, lines)
        for title, scale, lines in PANELS
        if any(_matching(series, key) for series in data for key, _, _ in lines)
    ]
    if not panels:
        raise DataError(
            "none of the runs has loss, grad_norm, loss_scale or throughput to plot: pass the "
            "dump folders of runs that logged a step"
        )
    cols = len(panels) if len(panels) <= 3 else 2  # every cell of the grid holds a panel
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(6.4 * cols, 4.0 * rows))
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, (title, scale, lines) in zip(axes, panels, strict=True):
        for i, (label, series) in enumerate(zip(_labels(runs), data, strict=True)):
            for key, style, suffix in lines:
                names = _matching(series, key)
                for name in names:
                    steps = sorted(series[name])
                    plugin = f" ({name.split('/')[0]})" if len(names) > 1 else ""
                    ax.plot(
                        steps,
                        [series[name][step] for step in steps],
                        style,
                        color=f"C{i % 10}",
                        marker="o" if len(steps) == 1 else None,
                        label=label + suffix + plugin,
                    )
        values = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
        if scale == "log" and values and min(values) > 0 and max(values) < 10 * min(values):
            scale = "linear"  # under a decade a log axis labels only minor ticks, as 9x10^-1
        ax.set(title=title, xlabel="step", yscale=scale)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
