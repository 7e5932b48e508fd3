"""The ``plugtrain`` command's own help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugtrain.cli import COMMANDS, main
from plugtrain.commands.train import train
from plugtrain.data.prepare import SHARD_TOKENS
from plugtrain.training.launch import run_cli

REPO = Path(__file__).resolve().parents[1]


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
        ["plugtrain", "inspect-data"],
        ["plugtrain", "estimate"],
        ["plugtrain", "export-hf"],
        ["plugtrain", "generate"],
        ["plugtrain", "eval"],
    ]


def test_prepare_data_help_states_the_default_shard_size(capsys):
    text = " ".join(help_of(["prepare-data"], capsys))
    assert SHARD_TOKENS == 2**28 and "(default: 2^28, 512 MiB of uint16)" in text


def test_plugins_help_shows_the_options_it_takes(capsys):
    lines = help_of(["plugins"], capsys)
    assert lines[0] == "usage: plugtrain plugins [-h] [--config FILE] [--plugins.enabled NAMES]"


def test_train_is_train_py_under_its_own_name(capsys):
    assert main(["train", "--help"]) == 0
    ours = capsys.readouterr().out.splitlines()
    assert train(["--help"]) == 0
    theirs = capsys.readouterr().out.splitlines()
    assert ours[0] == "usage: plugtrain train [--config FILE] [--section.key VALUE ...]"
    assert [line.replace("plugtrain train", "train.py") for line in ours] == theirs
    assert main(["train", "--training.stepz", "3"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("plugtrain: error: unknown config key 'training.stepz'")


@pytest.mark.parametrize(
    "argv",
    [[REPO / "train.py", "--help"], ["-m", "plugtrain", "--help"], ["-m", "plugtrain", "plugins"]],
    ids=["train.py --help", "plugtrain --help", "plugtrain plugins"],
)
def test_output_into_a_pipe_whose_reader_left_ends_quietly(argv):
    read, write = os.pipe()
    os.close(read)  # the reader left before the first line, as `head` may
    # Buffered, as a terminal's user runs it (unbuffered, argparse's own help swallows the error).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with os.fdopen(write, "wb") as out:
        result = subprocess.run(
            [sys.executable, *argv], stdout=out, stderr=subprocess.PIPE, env=env
        )
    assert (result.returncode, result.stderr.decode()) == (141, "")


def test_a_broken_pipe_elsewhere_is_reported_as_an_error(capfd):
    def main() -> None:
        raise BrokenPipeError("a worker's pipe")

    assert run_cli(main) == 1
    assert "BrokenPipeError: a worker's pipe" in capfd.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["plugins"], ["train", "--training.stepz", "3"]],
    ids=["--help", "train --help", "plugins", "train with a config error"],
)
def test_what_needs_no_torch_does_not_import_it(argv):
    # At exit, whether the command imported torch: seconds of start-up on a loaded machine.
    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr))\n"
        f"sys.argv = ['plugtrain', *{argv!r}]\n"
        "runpy.run_module('plugtrain', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.splitlines()[-1] == "False", result.stderr


def test_help_lists_every_command_and_imports_none_of_their_modules():
    # In a fresh process: what `plugtrain --help` imported, and what it printed.
    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.startswith("
        "'plugtrain.commands')), 'torch' in sys.modules, file=sys.stderr))\n"
        "sys.argv = ['plugtrain', '--help']\n"
        "runpy.run_module('plugtrain', run_name='__main__')\n"
    )
    env = {**os.environ, "COLUMNS": "200"}  # each command's summary on one line
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == "[] False"
    listed = {
        line.split()[0]: " ".join(line.split()[1:])
        for line in result.stdout.split("positional arguments:")[1].splitlines()[2:]
        if line.startswith("    ")
    }
    assert listed == {name: entry.summary for name, entry in COMMANDS.items()}


def test_a_command_runs_its_own_module_and_parser(capsys):
    assert sorted(help_of(["estimate"], capsys))  # its own parser, from its module
    assert main(["estimate", "debug", "--gpus", "0"]) == 2
    assert capsys.readouterr().err == "plugtrain: error: --gpus must be >= 1, got 0\n"
    with pytest.raises(SystemExit) as e:
        main(["plot", "a", "--training.steps", "3"])  # only plugins and estimate take these
    assert e.value.code == 2
    assert "unrecognized arguments: --training.steps 3" in capsys.readouterr().err
