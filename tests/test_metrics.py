"""Step metrics: the JSONL record, its sinks (TensorBoard, W&B), timing, MFU, console, logging."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import io
import json
import logging
import math
import re
import sys
import types

import pytest
import torch

from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import ConfigError
from plugtrain.model.llama.transformer import FLAVORS
from plugtrain.observability import limits, logs, timing
from plugtrain.observability.metrics import (
    CONSOLE_SHORT_FORMS,
    TensorBoardSink,
    format_line,
    use_color,
)
from plugtrain.observability.timing import StepTimer, throughput
from plugtrain.testing import SAMPLE, read_metrics, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

VALIDATION = SAMPLE / "validation.jsonl"

PHASE_KEYS = ["time_data_s", "time_fwd_bwd_s", "time_hooks_s", "time_optimizer_s"]
STEP_KEYS = {
    "step", "loss", "lr", "tokens_per_sec", "tokens_per_sec_per_rank", "tflops",
    "mfu_matmul_pct", "time_step_s", *PHASE_KEYS, "memory_gib", "skipped_steps",
}  # fmt: skip
TOKENS_PER_STEP = 4 * 32  # tiny_args: batch 4 x 32 tokens
TOKENIZER = SAMPLE / "tokenizer.json"


def train(folder, *args: str, steps: int = 3) -> Trainer:
    """Train the tiny model in this process (see runs.tiny_args), its matmul limit timed
    (``mfu(mm)``); returns the closed trainer."""
    limit = ("--metrics.matmul_limit", "true")
    config, host = configure([*tiny_args(folder, steps=steps), *limit, *args])
    trainer = Trainer(config, host)
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 30-step run with hook_recorder (vetoing step 3), validation and TensorBoard on."""
    folder = tmp_path_factory.mktemp("recorded")
    train(
        folder,
        "--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[3]",
        "--validation.interval", "10", "--validation.steps", "2",
        "--data.validation_path", str(VALIDATION),
        "--metrics.enable_tensorboard", "true",
        steps=30,
    )  # fmt: skip
    return folder, read_metrics(folder)


def test_step_records_hold_the_documented_fields_with_sane_values(recorded):
    _, records = recorded
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))  # log_freq 1
    vocab = Tokenizer.from_file(str(TOKENIZER)).vocab_size
    flops_per_token = dataclasses.replace(FLAVORS["tiny"], vocab_size=vocab).flops_per_token(32)
    for r in steps:
        by_plugin = {"skipped_steps.hook_recorder"} if r["step"] >= 3 else set()
        assert set(r) == STEP_KEYS | {"hook_recorder/vetoed_steps"} | by_plugin, r  # no mfu_pct
        # The learning rate is a float32 tensor: its peak is 3e-3 rounded to float32.
        assert math.isfinite(r["loss"]) and 0 < r["lr"] <= torch.tensor(3e-3).item()
        assert r["time_step_s"] == pytest.approx(sum(r[k] for k in PHASE_KEYS))
        assert r["time_fwd_bwd_s"] > 0 and all(r[k] >= 0 for k in PHASE_KEYS)
        assert r["tokens_per_sec"] == pytest.approx(TOKENS_PER_STEP / r["time_step_s"])
        assert r["tokens_per_sec_per_rank"] == r["tokens_per_sec"] > 0  # one rank
        assert r["tflops"] == pytest.approx(r["tokens_per_sec"] * flops_per_token / 1e12)
        # One matmul limit, timed at start-up, against each window's step time.
        limit_s = r["mfu_matmul_pct"] * r["time_step_s"] / 100
        assert limit_s == pytest.approx(steps[0]["mfu_matmul_pct"] * steps[0]["time_step_s"] / 100)
        assert limit_s > 0
        assert 0.05 < r["memory_gib"] < 64
        vetoed = int(r["step"] >= 3)
        assert r["skipped_steps"] == r["hook_recorder/vetoed_steps"] == vetoed
    losses = [r["loss"] for r in steps]
    assert losses[0] > math.log(vocab)  # a fresh model is no better than uniform
    # The mean, not the max: one batch of the shuffled order may be hard.
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    validation = [r for r in records if "validation_loss" in r]
    assert [(set(r), r["step"]) for r in validation] == [
        ({"step", "validation_loss", "validation_bpb"}, s) for s in (10, 20, 30)
    ]
    assert validation[-1]["validation_loss"] < validation[0]["validation_loss"]


def test_plugin_metrics_and_the_matmul_limit_absent_when_off(tmp_path):
    train(tmp_path, "--metrics.matmul_limit", "false", steps=2)
    for record in read_metrics(tmp_path):
        assert set(record) == STEP_KEYS - {"mfu_matmul_pct"}


def test_resolved_config_and_plugin_versions_written_at_start(recorded):
    folder, _ = recorded
    config = json.loads((folder / "config.json").read_text())
    assert config["training"]["steps"] == 30  # the command-line override
    assert config["model"]["flavor"] == "tiny"
    assert config["hook_recorder"] == {"veto_steps": [3]}  # the plugin's section
    run = json.loads((folder / "run.json").read_text())
    assert run["plugins"] == {"hook_recorder": {"distribution": "plugtrain-hook-recorder 0.1.0"}}
    assert run["torch"] == torch.__version__ and run["world_size"] == 1
    assert (run["device"], run["gpu"]) == ("cpu", None)


def test_tensorboard_events_read_back_equal_the_jsonl(recorded):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, records = recorded
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == (STEP_KEYS - {"step"}) | {
        "hook_recorder/vetoed_steps", "skipped_steps.hook_recorder", "validation_loss",
        "validation_bpb",
    }  # fmt: skip
    for tag in ("loss", "validation_loss", "tokens_per_sec", "skipped_steps.hook_recorder"):
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


class FakeWandb(types.ModuleType):
    """Records the calls plugtrain makes to the ``wandb`` module (no network, no service)."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.init_kwargs: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_gets_every_record_and_the_config(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train(tmp_path, "--metrics.enable_wandb", "true", "--metrics.wandb_project", "shakespeare")
    kwargs = fake.init_kwargs
    assert (kwargs["project"], kwargs["name"], kwargs["dir"]) == (
        "shakespeare", tmp_path.name, str(tmp_path)
    )  # fmt: skip
    assert kwargs["config"]["training"]["steps"] == 3
    records = read_metrics(tmp_path)
    assert fake.logged == [
        ({k: v for k, v in r.items() if k != "step"}, r["step"]) for r in records
    ]
    assert fake.finished


@pytest.mark.parametrize(
    ("option", "module", "extra"),
    [("enable_tensorboard", "tensorboard", "tensorboard"), ("enable_wandb", "wandb", "wandb")],
)
def test_missing_optional_package_is_one_line_naming_the_extra(
    tmp_path, monkeypatch, option, module, extra
):
    monkeypatch.setitem(sys.modules, module, None)  # import and find_spec now fail
    with pytest.raises(ConfigError) as e:
        configure([*tiny_args(tmp_path), f"--metrics.{option}", "true"])
    assert str(e.value) == (
        f"metrics.{option} needs the '{module}' package, which is not installed: "
        f"pip install 'plugtrain[{extra}]'"
    )


def fake_clock(monkeypatch, readings: list[float]) -> None:
    ticks = iter(readings)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))


def test_step_timer_splits_each_step_into_phases_and_averages_a_window(monkeypatch):
    timer = StepTimer(torch.device("cpu"))
    steps = [  # (phase ended, clock reading); None starts the step
        [(None, 0.0), ("data", 0.1), ("fwd_bwd", 1.1), ("hooks", 1.2), ("fwd_bwd", 2.2),
         ("hooks", 2.4), ("optimizer", 3.4)],
        [(None, 10.0), ("data", 10.3), ("fwd_bwd", 11.3), ("hooks", 11.4), ("optimizer", 12.4)],
    ]  # fmt: skip
    fake_clock(monkeypatch, [t for step in steps for _, t in step])
    for step in steps:
        for phase, _ in step:
            timer.start_step() if phase is None else timer.lap(phase)
    assert timer.window() == pytest.approx(
        {
            "time_step_s": (3.4 + 2.4) / 2,
            "time_data_s": (0.1 + 0.3) / 2,
            "time_fwd_bwd_s": (2.0 + 1.0) / 2,
            "time_hooks_s": (0.3 + 0.1) / 2,
            "time_optimizer_s": (1.0 + 1.0) / 2,
        }
    )
    assert timer.window()["time_step_s"] == 0  # a new, empty window


def test_throughput_tflops_and_mfu():
    out = throughput(4096, 0.5, 8, 6_000_000, peak=989.5)
    assert out["tokens_per_sec"] == 8192 and out["tokens_per_sec_per_rank"] == 1024
    assert out["tflops"] == pytest.approx(1024 * 6e6 / 1e12)
    assert out["mfu_pct"] == pytest.approx(100 * out["tflops"] / 989.5)
    assert "mfu_pct" not in throughput(4096, 0.5, 8, 6_000_000, peak=None)
    # The matmul limit: the step's GEMMs alone take 0.4 s of its 0.5.
    limited = throughput(4096, 0.5, 8, 6_000_000, peak=None, matmul_step_seconds=0.4)
    assert limited["mfu_matmul_pct"] == pytest.approx(80.0)
    assert "mfu_matmul_pct" not in out


def test_a_ratio_above_100_percent_is_flagged_never_given():
    full = throughput(4096, 0.5, 8, 6_000_000, peak=None, matmul_step_seconds=0.5)
    assert full["mfu_matmul_pct"] == 100.0
    # The step beat its limits: the GEMMs alone took longer, the GPU ran above its peak.
    beaten = throughput(4096, 0.5, 8, 6_000_000, peak=0.001, matmul_step_seconds=0.6)
    assert beaten.keys() == {
        "tokens_per_sec", "tokens_per_sec_per_rank", "tflops", "mfu_over_100",
        "mfu_matmul_over_100",
    }  # fmt: skip
    assert beaten["mfu_over_100"] is beaten["mfu_matmul_over_100"] is True


def test_a_matmul_limit_measured_too_low_is_flagged_on_the_console_and_in_the_file(
    tmp_path, monkeypatch, capsys, restore_logger
):
    timed = []

    def slow(shapes, device, dtype, rounds=limits.ROUNDS):  # as if other jobs held the CPU
        timed.append(shapes)
        return dict.fromkeys(shapes, 100.0)

    monkeypatch.setenv("PLUGTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(limits, "time_shapes", slow)
    train(tmp_path, steps=2)
    lines = re.findall(r"INFO (step +\d+ \|.*)$", capsys.readouterr().err, re.MULTILINE)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and len(lines) == 2
    for record, line in zip(records, lines, strict=True):
        assert record["mfu_matmul_over_100"] is True and "mfu_matmul_pct" not in record
        assert f"| mfu(mm) >100%? | tflops {record['tflops']:.3g} |" in line, line
    # Timed once, at start-up: a re-timing would cost more than its share of the run.
    assert len(timed) == 1


def test_a_matmul_limit_that_runs_out_of_memory_is_left_out(
    tmp_path, monkeypatch, capsys, restore_logger
):
    def out_of_memory(shapes, device, dtype, rounds=limits.ROUNDS):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setenv("PLUGTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(limits, "time_shapes", out_of_memory)
    train(tmp_path, steps=1)
    assert set(read_metrics(tmp_path)[0]) == STEP_KEYS - {"mfu_matmul_pct"}
    assert re.findall(r"WARNING (.*)", capsys.readouterr().err) == [
        "mfu(mm) is not reported: timing the step's GEMMs ran out of memory (set "
        "metrics.matmul_limit = false to skip it)"
    ]


RECORD = {
    "step": 20, "loss": 5.123456, "lr": 0.003, "grad_clip/grad_norm": 0.81234,
    "grad_clip/clipped": 0.0, "grad_scaler/loss_scale": 65536.0, "spike_guard/rewinds": 0,
    "tokens_per_sec": 5012.4, "tokens_per_sec_per_rank": 2506.2,
    "tflops": 0.0213, "mfu_pct": 41.23, "time_step_s": 0.16234, "time_data_s": 0.0012,
    "time_fwd_bwd_s": 0.14, "time_hooks_s": 0.0003, "time_optimizer_s": 0.021,
    "memory_gib": 0.4112, "skipped_steps": 2, "skipped_steps.grad_scaler": 2,
}  # fmt: skip
SHOWN = {"grad_clip/grad_norm": False, "grad_scaler/loss_scale": False, "spike_guard/rewinds": True}
LINE = (
    "step    20 | loss 5.1235 | grad_clip/grad_norm 0.8123 | grad_scaler/loss_scale 65,536 | "
    "lr 3.00e-03 | tok/s 5,012 | mfu 41.2% | mem 0.41GiB | time 162ms | "
    "skipped 2 (grad_scaler 2)"
)


def test_console_line_format():
    assert format_line(RECORD, shown=SHOWN) == LINE
    # Only the plugin metrics their plugins chose; counts flagged nonzero once they are not 0.
    assert format_line(RECORD) == LINE.replace(
        "grad_clip/grad_norm 0.8123 | grad_scaler/loss_scale 65,536 | ", ""
    )
    rewound = format_line({**RECORD, "spike_guard/rewinds": 1}, shown=SHOWN)
    assert rewound == LINE.replace("65,536 | ", "65,536 | spike_guard/rewinds 1 | ")
    # tflops when the peak is unknown; nothing about skips before the first.
    quiet = {k: v for k, v in RECORD.items() if k != "mfu_pct"}
    assert format_line({**quiet, "skipped_steps": 0}, shown=SHOWN) == LINE.replace(
        "mfu 41.2%", "tflops 0.0213"
    ).replace(" | skipped 2 (grad_scaler 2)", "")
    # On CPU, the fraction of the matmul limit instead; where the step beat it, a flag and the
    # achieved TFLOP/s.
    assert format_line({**quiet, "mfu_matmul_pct": 80.04}, shown=SHOWN) == LINE.replace(
        "mfu 41.2%", "mfu(mm) 80.0%"
    )
    assert format_line({**quiet, "mfu_matmul_over_100": True}, shown=SHOWN) == LINE.replace(
        "mfu 41.2%", "mfu(mm) >100%? | tflops 0.0213"
    )
    assert format_line({**quiet, "mfu_over_100": True}, shown=SHOWN) == LINE.replace(
        "mfu 41.2%", "mfu >100%? | tflops 0.0213"
    )
    validation = {"step": 50, "validation_loss": 4.75, "validation_bpb": 2.01}
    validation |= {"ema/validation_loss": 4.8, "ema/validation_bpb": 2.03}
    assert format_line(validation, shown={"ema/validation_loss": False}) == (
        "step    50 | validation_loss 4.7500 | validation_bpb 2.0100 | ema/validation_loss 4.8000"
    )


def test_console_line_colors_only_decorate():
    colored = format_line(RECORD, color=True, shown=SHOWN)
    assert "\x1b[1mstep    20\x1b[0m" in colored and "\x1b[36mloss 5.1235\x1b[0m" in colored
    assert re.sub(r"\x1b\[\d+m", "", colored) == LINE


def console_pairs(line: str) -> list[tuple[str, str]]:
    """A console line's ``(record key, shown value)`` pairs: each label read as its key, or
    through CONSOLE_SHORT_FORMS; the plugins after ``skipped`` as ``skipped_steps.<plugin>``."""
    pairs = []
    for part in line.split(" | "):
        label, value = part.split(" ", 1)
        if label == "skipped":
            value, _, by = value.partition(" (")
            for vetoed in filter(None, by.removesuffix(")").split(", ")):
                plugin, count = vetoed.split(" ")
                pairs.append((f"skipped_steps.{plugin}", count))
        pairs.append((CONSOLE_SHORT_FORMS.get(label, label), value.strip()))
    return pairs


def test_with_every_shipped_plugin_the_console_is_short_and_names_each_value(
    tmp_path, capsys, restore_logger, repo
):
    # dpo answers the loss, on preference data alone: plugins/dpo/tests trains it.
    shipped = sorted(
        p.name
        for p in (repo / "plugins").iterdir()
        if (p / "pyproject.toml").exists() and p.name != "dpo"
    )
    assert {"ema", "grad_clip", "grad_scaler", "spike_guard", "z_loss"} <= set(shipped)
    train(
        tmp_path, "--plugins.enabled", ",".join(shipped),
        "--training.mixed_precision_param", "float16",  # the loss scaler acts
        "--compile.backend", "eager", "--spike_guard.max_consecutive", "0",
        "--validation.interval", "2", "--validation.steps", "1",
        "--data.validation_path", str(VALIDATION),
        steps=4,
    )  # fmt: skip
    err = capsys.readouterr().err
    lines = re.findall(r"^\d\d:\d\d:\d\d INFO (step +\d+ \|.*)$", err, re.MULTILINE)
    records = read_metrics(tmp_path)
    assert len(lines) == len(records) == 6  # 4 steps, 2 validations
    shown = set()
    for line, record in zip(lines, records, strict=True):
        assert len(line) <= 160, line
        for key, value in console_pairs(line):
            assert key in record, (key, line)
            number = re.sub(r",|%|GiB|ms$", "", value)
            decimals = len(number.split("e")[0].partition(".")[2])
            expected = record[key] * (1e3 if key == "time_step_s" else 1)
            # Equal to the shown precision: its last digit, or 3 significant ones.
            last_digit = 0 if "e" in number else 0.5 * 10**-decimals
            rounding = pytest.approx(expected, rel=5e-3, abs=last_digit)
            assert float(number) == rounding, (key, line)
            shown.add(key)
    shown_always = {"validation_bpb", "grad_clip/grad_norm", "grad_scaler/loss_scale"}
    assert shown_always | {"ema/validation_loss"} <= shown
    assert not any(k.startswith("spike_guard/") for k in shown)  # no rewind in this run
    assert len(set(CONSOLE_SHORT_FORMS.values())) == len(CONSOLE_SHORT_FORMS)  # one-to-one


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("env", "tty", "expected"),
    [
        ({}, True, True),
        ({}, False, False),
        ({"FORCE_COLOR": "1"}, False, True),
        ({"NO_COLOR": "1"}, True, False),
        ({"NO_COLOR": "1", "FORCE_COLOR": "1"}, True, False),
        ({"NO_COLOR": ""}, True, True),  # set but empty: ignored (no-color.org)
    ],
)
def test_color_when_a_terminal_unless_no_color(monkeypatch, env, tty, expected):
    for name in ("NO_COLOR", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert use_color(Stream(tty)) is expected


@pytest.fixture
def restore_logger():
    log = logging.getLogger("plugtrain")
    saved = log.handlers[:], log.level, log.propagate
    yield log
    log.handlers[:], log.level, log.propagate = saved


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_logs_info_other_ranks_warnings_once_with_their_rank(capsys, restore_logger, rank):
    logs.setup_logging(rank)
    log = restore_logger
    log.info("step line")
    for _ in range(3):
        log.warning("loss scale fell to %d", 1)
    log.warning("another warning")
    lines = capsys.readouterr().err.splitlines()
    messages = [re.sub(r"^(\[rank \d\] )?\d\d:\d\d:\d\d ", "", line) for line in lines]
    expected = ["WARNING loss scale fell to 1", "WARNING another warning"]
    assert messages == (["INFO step line", *expected] if rank == 0 else expected)
    assert all(line.startswith("[rank 1] ") for line in lines) == (rank == 1)


def test_all_ranks_option_logs_info_everywhere(capsys, restore_logger):
    logs.setup_logging(3, all_ranks=True)
    restore_logger.info("hello")
    assert re.fullmatch(r"\[rank 3\] \d\d:\d\d:\d\d INFO hello\n", capsys.readouterr().err)


def test_a_new_run_moves_an_earlier_runs_metrics_aside(tmp_path, one_thread):
    for steps in (2, 3):  # in this process: no Python and torch start-up each
        train(tmp_path, steps=steps)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    moved = (tmp_path / "metrics.1.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved] == [1, 2]


def test_text_goes_to_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = {"step": 3, "validation_loss": 4.5, "samples/0": "ROMEO: what light"}
    sink = TensorBoardSink(tmp_path)
    sink.write(record)
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["validation_loss"]
    (text,) = events.Tensors("samples/0/text_summary")
    assert (text.step, text.tensor_proto.string_val) == (3, [b"ROMEO: what light"])
