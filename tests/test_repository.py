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


# What names a package index: the two public hosts CI used to name, any "/simple" index path,
# pip's index options and a PIP_*INDEX_URL set to a literal URL. Written as regular expressions
# (escaped dots, optional groups), so this file does not match its own patterns.
INDEX_PATTERNS = re.compile(
    r"download\.pytorch\.org"
    r"|pypi\.org/simple"
    r"|files\.pythonhosted\.org"
    r"|https?://[^\s\"']+/simple\b"
    r"|--(?:extra-)?index-url"
    r"|PIP_(?:EXTRA_)?INDEX_URL\s*[:=]\s*[\"']?https?://"
)


def index_url_mentions(repo) -> list[str]:
    """``path:line: text`` for each tracked text file line that names a package index."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    found = []
    for name in filter(None, files):
        path = repo / name
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if INDEX_PATTERNS.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_tracked_file_names_a_package_index(repo):
    """Where packages come from is the installer's configuration (pip.conf, PIP_* variables,
    a CI repository variable), never the repository's."""
    assert index_url_mentions(repo) == []


def test_the_package_index_check_finds_what_it_looks_for(tmp_path):
    # Built at run time, so that no tracked file spells them out.
    host, https = ".".join(["download", "pytorch", "org"]), "https:" + "//"
    lines = [
        f"PIP_INDEX_URL: {https}{host}/whl/cpu",
        f"  PIP_EXTRA_INDEX_URL: '{https}mirror.example/simple'",
        "pip install " + "--" + f"extra-index-url {https}mirror.example/x torch",
        f"index = {https}mirror.example/simple/",
    ]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "ci.yml").write_text("\n".join(["ok: 1", *lines]) + "\n")
    (tmp_path / "binary.bin").write_bytes(b"\0" + lines[0].encode())
    (tmp_path / "untracked.txt").write_text(lines[0])
    subprocess.run(["git", "add", "ci.yml", "binary.bin"], cwd=tmp_path, check=True)
    assert index_url_mentions(tmp_path) == [
        f"ci.yml:{number}: {line.strip()}" for number, line in enumerate(lines, 2)
    ]
