"""downstream_eval on its own: its config section, its records for the model's and ema's
weights, and its cost on the training step.

These tests import only the plugin API and the test kit (``plugtrain.testing``). The scores
themselves are checked against a hand-written reference in the core's tests/test_evaluation.py.
"""

from __future__ import annotations

import json

import pytest

from plugtrain.plugin import ConfigError
from plugtrain.testing import SAMPLE, assert_costs, count_costs, setup_context, tiny_run

NAME = "downstream_eval"
ENABLED = ("--plugins.enabled", NAME)
VALIDATION = ("--validation.steps", "1", "--data.validation_path", str(SAMPLE / "validation.jsonl"))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("tasks", "[]", r"'downstream_eval\.tasks' must name at least one task file"),
        ("max_items", "-1", r"'downstream_eval\.max_items' must be >= 0, got -1"),
        ("batch_size", "0", r"'downstream_eval\.batch_size' must be >= 1, got 0"),
    ],
)
def test_a_bad_setting_is_a_one_line_config_error(option: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setup_context({}, *ENABLED, f"--{NAME}.{option}", value)


def test_two_tasks_of_one_name_are_refused(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    task = (SAMPLE / "cloze.jsonl").read_text().splitlines()[0] + "\n"
    (tmp_path / "a" / "cloze.jsonl").write_text(task)
    tasks = json.dumps(["sample:cloze.jsonl", str(tmp_path / "a" / "cloze.jsonl")])
    with pytest.raises(ConfigError, match=r"names two files called 'cloze': .* rename one"):
        tiny_run(tmp_path / "run", *ENABLED, f"--{NAME}.tasks", tasks, "--validation.interval",
                 "1", *VALIDATION, steps=1)  # fmt: skip


def test_without_validation_it_deactivates_itself_and_says_why(tmp_path) -> None:
    run = tiny_run(tmp_path / "run", *ENABLED, steps=1)
    plugins = json.loads((run.dump_folder / "run.json").read_text())["plugins"]
    assert plugins[NAME]["inactive"] == "validation.interval is 0: no validation to score tasks at"


def test_each_validation_logs_acc_for_the_model_and_for_ema_and_changes_nothing_else(
    tmp_path,
) -> None:
    args = ("--validation.interval", "2", *VALIDATION)
    run = tiny_run(tmp_path / "run", "--plugins.enabled", f"{NAME},ema", f"--{NAME}.max_items",
                   "12", *args, steps=4)  # fmt: skip
    plain = tiny_run(tmp_path / "plain", "--plugins.enabled", "ema", *args, steps=4)
    # No random number drawn, no parameter touched: the same run, plus its scores.
    assert run.checksums == plain.checksums
    keys = ("step", "loss", "lr", "validation_loss", "ema/validation_loss")
    assert [[r.get(k) for k in keys] for r in run.metrics] == [
        [r.get(k) for k in keys] for r in plain.metrics
    ]
    records = [r for r in run.metrics if "validation_loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        for weights in ("", "ema/"):
            for metric in ("acc", "acc_norm"):
                value = record[f"{weights}{NAME}/cloze/{metric}"]
                assert value * 12 == round(value * 12)  # a count over the 12 items


def test_no_host_sync_and_no_collective_on_a_training_step(tmp_path) -> None:
    # Validation at the last step only, in both runs that count_costs compares.
    args = (*ENABLED, f"--{NAME}.max_items", "4", "--validation.interval", "100", *VALIDATION)
    assert_costs(count_costs(tmp_path, *args, plugin=NAME), syncs=0, collectives={})
