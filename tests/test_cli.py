"""The ``plugtrain`` command's own help."""

from __future__ import annotations

import pytest

from plugtrain.cli import main, train


def help_of(argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_help_keeps_each_command_on_its_own_line(capsys):
    lines = help_of([], capsys)
    usage = [line.strip() for line in lines if line.startswith("  plugtrain ")]
    assert [line.split("#")[0].split()[:2] for line in usage] == [
        ["plugtrain", "train"],
        ["plugtrain", "plugins"],
        ["plugtrain", "plot"],
        ["plugtrain", "prepare-data"],
    ]


def test_plugins_help_shows_the_options_it_takes(capsys):
    lines = help_of(["plugins"], capsys)
    assert lines[0] == "usage: plugtrain plugins [-h] [--config FILE] [--plugins.enabled NAMES]"


def test_train_is_train_py_under_its_own_name(capsys):
    assert main(["train", "--help"]) == 0
    ours = capsys.readouterr().out.splitlines()
    assert train(["--help"]) == 0
    theirs = capsys.readouterr().out.splitlines()
    assert ours[0] == "usage: plugtrain train [--config FILE] [--section.key VALUE ...]"
    assert theirs[0] == "usage: train.py [--config FILE] [--section.key VALUE ...]"
    assert ours[1:] == theirs[1:]
    assert main(["train", "--training.stepz", "3"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("plugtrain: error: unknown config key 'training.stepz'")
