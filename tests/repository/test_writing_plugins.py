"""docs/writing-plugins.md's example, built from the page's own code blocks outside the
repository, installed (not editable) and tested with the kit alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FILE_BLOCK = re.compile(r"<!-- file: (?P<path>\S+) -->\n```\w*\n(?P<body>.*?)\n```", re.S)


def guide_files(repo: Path) -> dict[str, str]:
    """Each ``<!-- file: PATH -->`` code block of the guide, by PATH."""
    guide = (repo / "docs" / "writing-plugins.md").read_text()
    return {m["path"]: m["body"] + "\n" for m in FILE_BLOCK.finditer(guide)}


def test_the_guide_gives_a_whole_plugin(repo):
    assert set(guide_files(repo)) == {
        "pyproject.toml", "src/plugtrain_grad_stats/__init__.py", "tests/test_grad_stats.py",
    }  # fmt: skip


@pytest.mark.slow
def test_the_guides_plugin_installs_outside_the_repository_and_passes_its_tests(repo, tmp_path):
    project = tmp_path / "grad-stats"
    for path, body in guide_files(repo).items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(body)
    # A throwaway environment that sees this one's packages (plugtrain, torch, pytest), so
    # that the plugin is the only thing installed: from its folder, not editable, offline.
    # Without pip of its own, so that this environment's pip and setuptools build and install.
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
    )
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-build-isolation", "--no-index", "--quiet", str(project)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    # The kit's pytest plugin alone: the other installed ones cost seconds to import.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTHONPATH", None)
    kit = ["-p", "plugtrain.testing.pytest_plugin"]
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *kit, "tests"],
        cwd=project, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert "5 passed" in tests.stdout
    # It ran the installed copy, not a source folder on the path.
    where = subprocess.run(
        [str(python), "-c", "import plugtrain_grad_stats as m; print(m.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert "site-packages" in where.stdout and str(venv) in where.stdout
