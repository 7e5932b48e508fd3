"""plugtrain as a user installs it: a wheel (not editable) that trains in an empty folder."""

from __future__ import annotations

import os
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


@pytest.mark.slow
def test_a_wheel_install_trains_the_debug_model_in_an_empty_folder(tmp_path):
    # Built from a copy: an in-place build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    for part in ("core", "configs", "plugins/grad_clip", "plugins/downstream_eval"):
        ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
        shutil.copytree(REPO / part, source / part, symlinks=True, ignore=ignore)
    python = venv_seeing_only_the_dependencies(tmp_path / "venv", tmp_path / "deps")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONNOUSERSITE="1", PLUGTRAIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    plugins = [source / "plugins" / name for name in ("grad_clip", "downstream_eval")]
    subprocess.run(
        [*install, "--no-build-isolation", source / "core", *plugins],
        check=True,
        env=env,
        cwd=tmp_path,
    )
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
    where = subprocess.run(
        [python, "-c", "import plugtrain; print(plugtrain.__file__)"],
        env=env,
        cwd=empty,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(tmp_path / "venv")), where
