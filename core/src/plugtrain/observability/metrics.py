"""What a run reports: step metric records, their sinks and console line, and the run records.

Every logged step (every ``metrics.log_freq`` steps, and the first and last) rank 0 writes one
JSON object to ``<dump_folder>/metrics.jsonl`` and a short line to the console (see
:func:`format_line`). A record holds (the console's label in brackets where it is not the key):

================================  ============================================================
``step``                          the optimizer step (1-based)
``loss``                          training loss of the step, mean over ranks and microbatches
``lr``                            learning rate used by the step
``<plugin>/<key>``                a plugin's ``step_metrics`` (e.g. ``grad_clip/grad_norm``);
                                  only core keys have no ``/``; on the console only those the
                                  plugin chose (``SetupContext.show_on_console``)
``moe/<key>``                     family ``moe`` (``model.moe.balance``): each expert block's
                                  load ``imbalance.<block>`` (max over mean tokens per expert,
                                  summed over ranks), ``max_tokens.<block>``,
                                  ``min_tokens.<block>``, the worst ``imbalance``, every
                                  expert's ``tokens_per_expert.<block>.<expert>`` with
                                  ``metrics.moe_tokens_per_expert``; and the ``aux_loss`` and
                                  ``router_z_loss`` terms when on
``tokens_per_sec``                training tokens per second over all ranks [``tok/s``]
``tokens_per_sec_per_rank``       the same per rank
``tflops``                        achieved model TFLOP/s per rank (``ModelArgs.flops_per_token``)
``mfu_pct``                       model FLOPs utilisation in percent of the GPU's dense peak
                                  in the step's compute precision; absent on CPU or on a GPU
                                  of unknown peak [``mfu``, shown instead of ``tflops``]
``mfu_matmul_pct``                the same in percent of what torch's matmuls reach on this
                                  machine at the step's GEMM shapes, timed at start-up or
                                  cached, re-timed when a step beats it
                                  (``metrics.matmul_limit``); on a GPU beside ``mfu_pct``
                                  [``mfu(mm)``, shown instead of ``tflops``]
``mfu_over_100``,                 ``true`` in place of ``mfu_pct`` or ``mfu_matmul_pct`` above
``mfu_matmul_over_100``           100: the limit is no limit (a wrong peak, a matmul limit
                                  timed while other jobs slowed it), so no figure is given
                                  [``mfu >100%?``, ``mfu(mm) >100%?``, with ``tflops``]
``time_step_s``                   seconds per step, the sum of the four phases below [``time``,
                                  in ms; the phases are in the file only]
``time_data_s``                   waiting for the batch
``time_fwd_bwd_s``                forward and backward of every microbatch, plugins'
                                  ``loss_terms`` included
``time_hooks_s``                  the other step hooks: ``pre_backward``,
                                  ``unscale_gradients``, ``observe_gradients``,
                                  ``post_backward``, ``pre_step``, ``post_step``
``time_optimizer_s``              ``optimizer.step()``, LR scheduler and ``zero_grad``
``memory_gib``                    peak memory: CUDA max allocated, or the CPU's max RSS [``mem``]
``skipped_steps``                 steps vetoed so far (read on logging steps only) [``skipped``,
                                  shown once not 0]
``skipped_steps.<plugin>``        steps that plugin vetoed since the process started [``<plugin>``
                                  in parentheses after ``skipped``]
================================  ============================================================

Throughput and times are means over the steps since the previous logged step. Validation writes
records of their own: ``{"step": 50, "validation_loss": 4.75, "validation_bpb": 2.01,
"ema/validation_loss": 4.81, "ema/validation_bpb": 2.04}``, plus what plugins add
(``validation_metrics``), which may be text (``"samples/0": "ROMEO: ..."``).
``validation_bpb``, bits per byte, compares across tokenizers: the loss summed over every target
token of the validation batches, in bits, over the UTF-8 bytes of text those tokens stand for
(``Tokenizer.token_byte_lengths``: special tokens such as ``<|end_of_text|>`` stand for 0 bytes
but their loss counts; a SentencePiece tokenizer's leading space counts 1 byte per document).

A run resumed from a checkpoint, or rewound to one (a plugin's ``RunControl.rewind``), first
cuts the file back to the checkpoint's step, so that its records continue it as if the run had
never stopped, each step once (the undone steps' history is the rewinding plugin's to log). A
run without checkpoints started again in the same folder appends from step 1, so a step may
appear twice; readers keep the last record of a step (``plugtrain plot`` does).

Sinks: the JSONL file (always), TensorBoard (``[metrics] enable_tensorboard``, event files in
``<dump_folder>/tensorboard``) and Weights & Biases (``[metrics] enable_wandb``; set
``WANDB_MODE=offline`` to log without network). Each takes every key of every record: numbers
as scalars, text as TensorBoard text (W&B keeps a string as it is).

At start-up rank 0 also writes ``config.json`` (the resolved config, after overrides: what the
run uses) and ``run.json`` (plugins and their versions, torch, world size, device, the checkpoint
a resumed run continues, the LR schedule's planned length) to the dump folder.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from plugtrain import __version__
from plugtrain.errors import DumpFolderError

if TYPE_CHECKING:
    from plugtrain.config import JobConfig

logger = logging.getLogger("plugtrain")


def to_number(value: Any) -> float:
    """A metric value as a Python float (reads a tensor: a device sync on GPU)."""
    if isinstance(value, torch.Tensor):
        full_tensor = getattr(value, "full_tensor", None)
        value = (full_tensor() if full_tensor else value).item()
    return float(value)


# --------------------------------------------------------------------------- the console line

_RESET = "\x1b[0m"
_COLORS = {
    "bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "blue": "34",
    "magenta": "35", "cyan": "36",
}  # fmt: skip

CONSOLE_SHORT_FORMS = {
    "tok/s": "tokens_per_sec",
    "mfu": "mfu_pct",
    "mfu(mm)": "mfu_matmul_pct",
    "mem": "memory_gib",
    "time": "time_step_s",
    "skipped": "skipped_steps",
}
"""The console's labels that are not their record key, and the key each stands for."""

# The core's console fields around the plugins' chosen metrics: (record key, format, color).
_LEADING = (
    ("loss", "{:.4f}", "cyan"),
    ("validation_loss", "{:.4f}", "magenta"),
    ("validation_bpb", "{:.4f}", "magenta"),
)
_TRAILING = (
    ("lr", "{:.2e}", ""),
    ("tokens_per_sec", "{:,.0f}", "blue"),
    ("mfu_pct", "{:.1f}%", "green"),
    ("mfu_over_100", ">100%?", "red"),
    ("mfu_matmul_pct", "{:.1f}%", "green"),
    ("mfu_matmul_over_100", ">100%?", "red"),
    ("tflops", "{:.3g}", ""),  # only without an MFU, which says the same against a limit
    ("memory_gib", "{:.2f}GiB", "yellow"),
)
_HAS_MFU = {"mfu_pct", "mfu_matmul_pct"}
# A flag stands in for its MFU under the MFU's label (the figure's own key is absent).
_LABELS = {key: label for label, key in CONSOLE_SHORT_FORMS.items()} | {
    "mfu_over_100": "mfu",
    "mfu_matmul_over_100": "mfu(mm)",
}


def use_color(stream: IO[str]) -> bool:
    """Color when ``stream`` is a terminal, unless ``NO_COLOR`` is set; ``FORCE_COLOR`` forces
    it (https://no-color.org, https://force-color.org; NO_COLOR wins)."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _number(value: float) -> str:
    """A plugin metric for the console: integers as such, else 4 decimals or 3 significant."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return f"{value:,.0f}"
    if 1e-3 <= abs(value) < 1e4 or not math.isfinite(value):
        return f"{value:.4f}"
    return f"{value:.3g}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def format_line(
    record: Mapping[str, Any], color: bool = False, shown: Mapping[str, bool] | None = None
) -> str:
    """A short console line for a metrics record; every key stays in the JSONL file.

    ``step    10 | loss 5.1234 | grad_clip/grad_norm 0.8123 | lr 3.00e-03 | tok/s 5,012 |
    tflops 0.021 | mem 0.41GiB | time 162ms``, with ``mfu`` instead of ``tflops`` when the
    peak is known (``mfu(mm)`` against the CPU's matmul limit; ``mfu(mm) >100%?`` and
    ``tflops`` where the step beat it) and ``skipped 2 (grad_clip 2)`` once a step was vetoed.
    Each value is labelled with its record key, or with its short form in
    :data:`CONSOLE_SHORT_FORMS` (the vetoing plugins in parentheses stand for
    ``skipped_steps.<plugin>``). Of the plugins' metrics (``<plugin>/<key>``) only those in
    ``shown`` appear, in the order of their keys, as the plugins chose them with
    :meth:`~plugtrain.plugin.SetupContext.show_on_console`; one whose flag is true only while
    it is not zero.
    """
    shown = shown or {}
    parts = [("bold", f"step {record['step']:>5}")]
    parts += [(c, f"{k} {fmt.format(record[k])}") for k, fmt, c in _LEADING if k in record]
    parts += [
        ("", f"{k} {_number(record[k])}")
        for k in sorted(shown)  # whatever order the plugins were registered in
        if k in record and not (shown[k] and record[k] == 0)
    ]
    parts += [
        (c, f"{_LABELS.get(k, k)} {fmt.format(record[k])}")
        for k, fmt, c in _TRAILING
        if k in record and not (k == "tflops" and _HAS_MFU & record.keys())
    ]
    if "time_step_s" in record:
        parts.append(("dim", f"time {_ms(record['time_step_s'])}ms"))
    if record.get("skipped_steps"):
        by = ", ".join(
            f"{k.removeprefix('skipped_steps.')} {v}"
            for k, v in record.items()
            if k.startswith("skipped_steps.") and v
        )
        parts.append(("red", f"skipped {record['skipped_steps']}" + (f" ({by})" if by else "")))
    return " | ".join(
        f"\x1b[{_COLORS[style]}m{text}{_RESET}" if color and style else text
        for style, text in parts
    )


# --------------------------------------------------------------------------- sinks


class TensorBoardSink:
    """Scalars and text into TensorBoard event files under ``folder``, one tag per record key."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: Mapping[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, record["step"])
            elif key != "step":
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run; ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` later)."""

    def __init__(self, folder: Path, project: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=folder.name, dir=str(folder), config=config)

    def write(self, record: Mapping[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def truncate_metrics(path: Path, step: int) -> int:
    """Cut the JSONL metrics file at ``path`` before its first record of a step after ``step``
    (or its first unreadable or unfinished line, left by a crash); return the bytes removed.

    A resumed run then appends its records to exactly what an uninterrupted run would have
    written by ``step``.
    """
    if not path.is_file():
        return 0
    keep = 0
    with path.open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                record = json.loads(line)
            except ValueError:
                break
            if isinstance(record, dict) and record.get("step", 0) > step:
                break
            keep += len(line)
    removed = path.stat().st_size - keep
    if removed:
        os.truncate(path, keep)
    return removed


class MetricsLogger:
    """Writes each record to ``<dump_folder>/metrics.jsonl``, the console and the optional sinks.

    Only the process built with ``enabled=True`` (rank 0) writes anything.
    """

    def __init__(self, config: JobConfig, *, enabled: bool) -> None:
        self.enabled = enabled
        self.folder = Path(config.job.records_folder)
        self.path = self.folder / "metrics.jsonl"
        self.color = use_color(sys.stderr)
        self.shown: dict[str, bool] = {}
        """The plugin metrics on the console line (``SetupContext.console``); the trainer sets
        it once the plugins are set up."""
        self._file: IO[str] | None = None
        self._sinks: list[TensorBoardSink | WandbSink] = []
        if not enabled:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        cfg = config.metrics
        if cfg.enable_tensorboard:
            self._sinks.append(TensorBoardSink(self.folder / "tensorboard"))
        if cfg.enable_wandb:
            self._sinks.append(WandbSink(self.folder, cfg.wandb_project, config.to_dict()))

    def start(self, step: int) -> None:
        """Open ``metrics.jsonl`` for a run that continues after ``step`` (0: a new run).

        A resumed (or rewound) run cuts the file back to ``step``, so that its records continue
        the interrupted run's exactly and each step has one record. A new run moves an earlier
        run's file aside, to ``metrics.<N>.jsonl``, rather than mixing its records with it or
        deleting it.
        """
        if not self.enabled:
            return
        if self._file is not None:  # a rewind
            self._file.close()
        if step:
            truncate_metrics(self.path, step)
        elif self.path.is_file() and self.path.stat().st_size:
            n = 1
            while (self.folder / f"metrics.{n}.jsonl").exists():
                n += 1
            self.path.rename(self.folder / f"metrics.{n}.jsonl")
            logger.info("an earlier run's metrics.jsonl was moved to metrics.%d.jsonl", n)
        self._file = self.path.open("a")

    def log(self, record: Mapping[str, Any]) -> None:
        """Record one step's metrics; ``record`` holds ``step``, plain numbers and text."""
        if not self.enabled:
            return
        assert self._file is not None, "MetricsLogger.start() opens the file"
        try:
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()
        except OSError as e:
            raise self._write_failed(e) from e
        for sink in self._sinks:
            sink.write(record)
        logger.info(format_line(record, self.color, self.shown))

    def _write_failed(self, error: OSError) -> DumpFolderError:
        """The one-line error for a failed write (a full disk); the file is let go, unflushed:
        a resume cuts its unfinished last line."""
        with contextlib.suppress(OSError):  # closing flushes what failed again
            assert self._file is not None
            self._file.close()
        self._file = None
        try:
            space = (
                f" ({shutil.disk_usage(self.folder).free / 2**20:.1f} MiB free in {self.folder})"
            )
        except OSError:
            space = ""
        return DumpFolderError(
            f"cannot write {self.path}: {error.strerror or error}{space}; free space or set "
            "job.dump_folder elsewhere, then run the same command: it resumes from the latest "
            "complete checkpoint"
        )

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks.clear()


# --------------------------------------------------------------------------- run records


def write_run_records(
    config: JobConfig,
    plugins: Mapping[str, Mapping[str, Any]],
    world_size: int,
    device: torch.device,
    *,
    resumed_from: Mapping[str, Any] | None = None,
    lr_schedule_steps: int | None = None,
    initial_load: Mapping[str, Any] | None = None,
    checkpoints: str | None = None,
    setup: Mapping[str, Any] | None = None,
) -> None:
    """Write ``config.json`` (the resolved config) and ``run.json`` to the dump folder (the
    local one, ``job.local_folder``, when ``job.dump_folder`` is a URL).

    ``plugins`` describes each enabled plugin (``PluginHost.report``): its distribution and
    version, and for one that deactivated itself in ``setup``, ``inactive`` with its reason.
    ``resumed_from`` is the checkpoint a resumed run continues (``path``, ``step``), and
    ``lr_schedule_steps`` the steps its LR schedule spans (a resume keeps the planned length,
    which may differ from ``training.steps``). ``initial_load`` is what a fresh start's
    weights came from (``checkpoint.initial_load_path``: ``kind``, ``path``, the Hugging Face
    ``model`` or the checkpoint's ``step``, the sha256 of its ``config.json``).
    ``checkpoints`` is where the run's checkpoints go (a folder or a URL; None: none saved).
    ``setup`` is the modes the run trains in (``training.run_info.run_setup``: attention,
    positions, parallel layout, loss mask, chat template).
    """
    folder = Path(config.job.records_folder)
    folder.mkdir(parents=True, exist_ok=True)
    run = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "plugins": {name: dict(about) for name, about in plugins.items()},
        "plugtrain": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "world_size": world_size,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "resumed_from": dict(resumed_from) if resumed_from is not None else None,
        "lr_schedule_steps": lr_schedule_steps,
        "initial_load": dict(initial_load) if initial_load is not None else None,
        "checkpoints": checkpoints,
        "setup": dict(setup) if setup is not None else None,
    }
    for name, data in (("config.json", config.to_dict()), ("run.json", run)):
        (folder / name).write_text(json.dumps(data, indent=2) + "\n")
    listed = ", ".join(
        f"{name} ({about['distribution']}"
        + (f"; inactive: {about['inactive']})" if "inactive" in about else ")")
        for name, about in plugins.items()
    )
    logger.info("plugins: %s; config and run records in %s", listed or "none", folder)
