"""The repository's promises: README's commands are CI's, and the code is lint-clean."""

from __future__ import annotations

import re
import subprocess
import sys


def readme_command(repo, label: str) -> str:
    """The command in the fenced block that follows README's line ``<!-- label -->``."""
    text = (repo / "README.md").read_text()
    match = re.search(rf"<!-- {label} -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
    assert match, f"README.md has no '<!-- {label} -->' command block"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_setup_and_test_commands(repo):
    ci = [
        line
        for line in (repo / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [readme_command(repo, "setup"), readme_command(repo, "test")]


def test_readme_run_command_is_plain_train_py(repo):
    assert readme_command(repo, "run") == "python train.py"


def test_ruff_lint_and_format_are_clean(repo):
    for cmd in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *cmd], cwd=repo, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_plugin_folder_is_a_distribution_with_tests(repo):
    import tomllib

    for folder in sorted((repo / "plugins").iterdir()):
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        (entry_point,) = project["entry-points"]["plugtrain.plugins"]
        assert entry_point == folder.name
        assert project["name"] == "plugtrain-" + folder.name.replace("_", "-")
        assert (folder / "src" / f"plugtrain_{folder.name}" / "__init__.py").is_file()
        assert (folder / "tests").is_dir()
        assert f"-e ./plugins/{folder.name}" in (repo / "requirements-dev.txt").read_text()
