"""plugtrain as a user installs it, by README's commands: a wheel that trains in an empty folder."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from plugtrain.testing import read_metrics

REPO = Path(__file__).resolve().parents[1]


def venv_seeing_only_the_dependencies(venv: Path, deps: Path) -> Path:
    """A virtual environment (its python) that imports torch and the other installed packages
    through links in ``deps``, but no plugtrain: its distributions, their editable-install
    hooks (``.pth`` files, which a plain path entry does not run) and the repository stay out."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    deps.mkdir()
    for entry in Path(site.getsitepackages()[0]).iterdir():
        ours = entry.name.startswith(("plugtrain", "__editable__"))
        if not ours and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(f"{deps}\n")
    return python


def user_install(repo: Path, readme_command) -> list[list[str]]:
    """README's user install (its ``<!-- user install -->`` block), one argv per command: the
    pinned torch first, then the core and plugins, which keep it."""
    block = readme_command(repo, "user install")
    commands = [argv for line in block.splitlines() if (argv := shlex.split(line, comments=True))]
    (pin,) = re.findall(r"^torch==(\S+)$", (repo / "requirements-dev.txt").read_text(), re.M)
    assert commands[0] == ["python", "-m", "pip", "install", f"torch=={pin}"], block
    for argv in commands:
        assert argv[:4] == ["python", "-m", "pip", "install"], block
    return commands


@pytest.mark.slow
def test_the_readme_user_install_trains_the_debug_model_in_an_empty_folder(
    tmp_path, repo, readme_command
):
    commands = user_install(repo, readme_command)
    # Built from a copy: an in-place build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    folders = [arg for argv in commands for arg in argv if arg.startswith("./")]
    for part in ("configs", *folders):
        ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
        shutil.copytree(REPO / part, source / part, symlinks=True, ignore=ignore)
    python = venv_seeing_only_the_dependencies(tmp_path / "venv", tmp_path / "deps")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONNOUSERSITE="1", PLUGTRAIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    # README's commands as written, offline: every requirement must be met by the dependencies
    # already installed (the pinned torch among them), so none is downloaded or replaced.
    offline = ["--no-index", "--no-build-isolation", "-q"]
    for argv in commands:
        subprocess.run([python, *argv[1:], *offline], check=True, env=env, cwd=source)
    shutil.rmtree(source)  # nothing of the repository is left to find
    empty = tmp_path / "empty"
    empty.mkdir()
    plugtrain = tmp_path / "venv" / "bin" / "plugtrain"
    args = ["--config", "debug", "--training.steps", "2", "--job.dump_folder", "run"]
    result = subprocess.run(
        [plugtrain, "train", *args], env=env, cwd=empty, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(empty / "run")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("validation_loss" in r for r in records)
    assert "plugins: grad_clip (plugtrain-grad-clip 0.1.0), downstream_eval (" in result.stderr
    assert any("downstream_eval/cloze/acc" in r for r in records)  # the sample's task, shipped
    where, torch_version = subprocess.run(
        [python, "-c", "import plugtrain, torch; print(plugtrain.__file__, torch.__version__)"],
        env=env,
        cwd=empty,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert where.startswith(str(tmp_path / "venv")), where
    assert ["torch==" + torch_version.split("+")[0]] == commands[0][4:]  # the first command's
