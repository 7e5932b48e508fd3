"""``plugtrain plot``: a PNG comparing runs, drawn from their metrics.jsonl files."""

from __future__ import annotations

import json
import sys

import pytest

from plugtrain import cli
from plugtrain.errors import DataError, MissingFileError, UserError
from plugtrain.observability.plot import draw_runs, plot_runs, read_run
from plugtrain.testing import SAMPLE, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

VALIDATION = SAMPLE / "validation.jsonl"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_records(folder, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def synthetic_run(folder, steps: int = 20) -> None:
    """A run whose plugins logged grad_norm and loss_scale, with a validation every 5 steps."""
    records = []
    for s in range(1, steps + 1):
        records.append(
            {"step": s, "loss": 8 - 0.1 * s, "grad_clip/grad_norm": 2 / s,
             "grad_scaler/loss_scale": 2.0 ** (16 - s // 5), "tokens_per_sec": 5000.0 + s}
        )  # fmt: skip
        if s % 5 == 0:
            records.append({"step": s, "validation_loss": 8.2 - 0.08 * s})
    write_records(folder, records)


def image_shape(path) -> tuple[int, ...]:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape


def test_plot_command_writes_a_png_from_two_runs(tmp_path, capsys):
    real = tmp_path / "real"
    config, host = configure(
        [*tiny_args(real, steps=6), "--validation.interval", "3",
         "--validation.steps", "1", "--data.validation_path", str(VALIDATION)]
    )  # fmt: skip
    trainer = Trainer(config, host)
    trainer.run()
    synthetic_run(tmp_path / "synthetic")
    out = tmp_path / "plots" / "loss.png"
    assert cli.main(["plot", str(real), str(tmp_path / "synthetic"), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.stat().st_size > 30_000  # four panels of curves, not a blank canvas
    assert image_shape(out) == (800, 1280, 4)  # 2 x 2 panels of 6.4 x 4 inches at 100 dpi


def test_panels_without_data_are_left_out(tmp_path):
    write_records(tmp_path / "a", [{"step": s, "loss": 5.0 / s} for s in range(1, 5)])
    out = plot_runs([tmp_path / "a"], tmp_path / "loss.png")
    assert image_shape(out) == (400, 640, 4)  # the loss panel alone


def test_three_panels_fill_one_row_and_a_narrow_log_range_reads_plainly(tmp_path):
    # No loss_scale; a grad_norm between 0.66 and 1.05 (less than a decade) in one run.
    records = [{"step": s, "loss": 8 - 0.1 * s, "grad_clip/grad_norm": 0.66 + 0.02 * s,
                "tokens_per_sec": 5000.0 + s} for s in range(1, 21)]  # fmt: skip
    write_records(tmp_path / "narrow", records)
    fig = draw_runs([tmp_path / "narrow"])
    fig.draw_without_rendering()  # lays the tick labels out
    assert [ax.get_title() for ax in fig.axes] == [
        "loss", "grad_norm", "throughput (tokens/s, all ranks)"
    ]  # fmt: skip
    assert all(ax.get_visible() and ax.has_data() for ax in fig.axes)  # no blank cell
    grad_norm = fig.axes[1]
    labels = [t.get_text() for t in grad_norm.get_yticklabels()]
    assert grad_norm.get_yscale() == "linear" and "0.70" in labels and "1.00" in labels, labels
    # Over a decade (2 down to 0.1), grad_norm keeps its log scale.
    synthetic_run(tmp_path / "wide")
    assert draw_runs([tmp_path / "wide"]).axes[1].get_yscale() == "log"


def test_plot_writes_into_the_first_run_by_default(tmp_path, capsys, monkeypatch):
    synthetic_run(tmp_path / "a")
    synthetic_run(tmp_path / "b")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'a' / 'metrics.png'}"
    assert image_shape(tmp_path / "a" / "metrics.png") == (800, 1280, 4)
    assert (
        not list((tmp_path / "elsewhere").iterdir())
        and not (tmp_path / "b" / "metrics.png").exists()
    )
    assert plot_runs([tmp_path / "b" / "metrics.jsonl"]) == tmp_path / "b" / "metrics.png"


def test_last_record_of_a_step_wins(tmp_path):
    # A run resumed from step 2 after logging step 3 logs step 3 again.
    records = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}, {"step": 3, "loss": 7.5}]
    records += [{"step": 3, "loss": 7.0}, {"step": 3, "validation_loss": 7.2}]
    write_records(tmp_path, records)
    assert read_run(tmp_path) == {"loss": {1: 9.0, 2: 8.0, 3: 7.0}, "validation_loss": {3: 7.2}}


def test_bad_inputs_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(MissingFileError, match=r"no metrics file at '.*nope'"):
        read_run(tmp_path / "nope")
    write_records(tmp_path / "empty", [])
    with pytest.raises(DataError, match="holds no metrics records"):
        read_run(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{"loss": 3}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl' line 2 is not a metrics record"):
        read_run(tmp_path / "bad")
    write_records(tmp_path / "other", [{"step": 1, "hook_recorder/vetoed_steps": 0}])
    with pytest.raises(DataError, match="none of the runs has loss"):
        plot_runs([tmp_path / "other"], tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UserError, match=r"pip install 'plugtrain\[plot\]'"):
        plot_runs([tmp_path / "other"], tmp_path / "x.png")


def test_plot_command_errors_exit_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("plugtrain: error: no metrics file at")
    with pytest.raises(SystemExit) as e:
        cli.main(["plot", str(tmp_path), "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
