"""The ``plugtrain`` command's own help."""

from __future__ import annotations

import pytest

from plugtrain.cli import main


def help_of(argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_help_keeps_each_command_on_its_own_line(capsys):
    lines = help_of([], capsys)
    usage = [line.strip() for line in lines if line.strip().startswith("plugtrain p")]
    assert [line.split("#")[0].split()[:2] for line in usage] == [
        ["plugtrain", "plugins"],
        ["plugtrain", "plot"],
        ["plugtrain", "prepare-data"],
    ]
    assert (
        "Training runs through train.py: python train.py --help lists every config field." in lines
    )


def test_plugins_help_shows_the_options_it_takes(capsys):
    lines = help_of(["plugins"], capsys)
    assert lines[0] == "usage: plugtrain plugins [-h] [--config FILE] [--plugins.enabled NAMES]"
