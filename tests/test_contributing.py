"""The contributor workflow's pieces: the commit-message rules and the plugin template."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # the scripts under test are plain modules there

import check_commit_msg  # noqa: E402
import new_plugin  # noqa: E402

SOURCE_ID = "ghstack-source-id: 6b1b8ea2c1d84e0c9c0f62a7bd64b3c3e58c9a0e"
PULL_REQUEST = "Pull-Request: https://github.com/plugtrain/plugtrain/pull/12"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def make_repo(path: Path) -> Path:
    """An empty git repository with a committer identity, on branch main."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Test Contributor")
    git(path, "config", "user.email", "contributor@example.com")
    return path


def commit(repo: Path, message: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


# -- commit messages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "Add the grad_clip plugin",
        "config: coerce unions of several types",
        f"Add the grad_clip plugin\n\nClip the global norm.\n\n{SOURCE_ID}\n{PULL_REQUEST}",
        # What `ghstack land` makes: the suffix does not count towards the 72 characters.
        "A" * 72 + " (#12)" + f"\n\n{SOURCE_ID}\n{PULL_REQUEST}",
        "Embed the position in the rotary cache",  # "-ed" but imperative
    ],
)
def test_good_messages_pass(message):
    assert check_commit_msg.problems(message) == []


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ("", "the subject (first line) is empty"),
        ("A" * 73, "the subject is 73 characters long; keep it within 72"),
        ("Add the plugin.", "the subject ends with a period"),
        ("add the plugin", "the subject starts with a lowercase letter"),
        ("Added the plugin", "the subject starts with 'Added': use the imperative"),
        ("Fixes the warmup", "the subject starts with 'Fixes': use the imperative"),
        ("grad_clip: adding a test", "the subject starts with 'adding': use the imperative"),
        ("WIP scaler", "a work-in-progress commit"),
        ("fixup! Add the plugin", "'fixup!' commit: squash it first"),
        ("Add the plugin\nClip the norm", "the second line is not blank"),
        (
            f"Add the plugin\n\n{SOURCE_ID}\n{PULL_REQUEST}\n\n{SOURCE_ID}\n{PULL_REQUEST}",
            "2 'ghstack-source-id:' trailers (a squash of two submitted commits)",
        ),
    ],
)
def test_bad_messages_are_named(message, problem):
    found = check_commit_msg.problems(message)
    assert any(p.startswith(problem) for p in found), found


def test_checks_every_commit_of_a_range_and_names_the_bad_ones(tmp_path, capsys, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    base = commit(repo, "Add a", {"a": "a"})
    bad = commit(repo, "Added b.", {"b": "b"})
    commit(repo, "Add c", {"c": "c"})
    monkeypatch.chdir(repo)
    assert check_commit_msg.main([f"{base}..HEAD"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{bad[:10]} 'Added b.': the subject ends with a period",
        f"{bad[:10]} 'Added b.': the subject starts with 'Added': use the imperative "
        "('Add', 'Fix', 'Make')",
        "1 of 2 commit messages break the rules in CONTRIBUTING.md",
    ]
    # A push that created its branch has a null "before": only the pushed tip is checked.
    assert check_commit_msg.main([f"{'0' * 40}..HEAD"]) == 0
    assert capsys.readouterr().out.endswith(
        "1 commit messages checked: all follow CONTRIBUTING.md\n"
    )


def test_ci_checks_the_orig_commit_of_a_ghstack_pull_request():
    """A ghstack PR's head branch holds ghstack's synthetic commits; the contributor's commit
    is the tip of the orig branch."""
    assert check_commit_msg.pull_request_revisions("gh/alice/12/head", "b..h") == [
        "origin/gh/alice/12/orig^!"
    ]
    assert check_commit_msg.pull_request_revisions("fix-warmup", "b..h") == ["b..h"]


# -- the plugin template ---------------------------------------------------------------


@pytest.fixture
def workspace(tmp_path, repo) -> Path:
    """The files new_plugin.py works on: the template and requirements-dev.txt."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "templates").symlink_to(repo / "templates")
    (tmp_path / "requirements-dev.txt").write_text(
        "pytest>=8\n-e ./core\n-e ./plugins/alpha\n-e ./plugins/omega\n"
    )
    return tmp_path


@pytest.mark.parametrize("name", ["ab", "my_" + "x" * (new_plugin.MAX_NAME - 3)])
def test_new_plugin_is_the_template_renamed(workspace, name):
    folder = new_plugin.new_plugin(workspace, name)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "pyproject.toml",
        f"src/plugtrain_{name}/__init__.py",
        f"tests/test_{name}.py",
    ]
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["name"] == "plugtrain-" + name.replace("_", "-")
    assert project["entry-points"]["plugtrain.plugins"] == {
        name: f"plugtrain_{name}:{new_plugin.spellings(name)['TemplatePlugin']}"
    }
    for path in folder.rglob("*"):
        if path.is_file():
            assert "template" not in path.read_text().replace("templates/plugin", ""), path
    for ruff in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        # The shortest and the longest name: lines shrink and grow, they must stay clean.
        lint = subprocess.run(
            [sys.executable, "-m", "ruff", *ruff, str(folder)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert lint.returncode == 0, lint.stdout
    # Inserted among the plugin lines in alphabetical order, the rest untouched.
    assert (workspace / "requirements-dev.txt").read_text().splitlines() == [
        "pytest>=8",
        "-e ./core",
        *(f"-e ./plugins/{plugin}" for plugin in sorted(["alpha", "omega", name])),
    ]


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("Grad-Clip", "plugin name 'Grad-Clip' must be lowercase words joined by '_'"),
        ("class", "plugin name 'class' must be lowercase words joined by '_'"),
        ("x" * 33, "is longer than 32 characters"),
        ("alpha", "already exists: choose another name"),
    ],
)
def test_new_plugin_refuses_bad_names(workspace, name, error):
    (workspace / "plugins" / "alpha").mkdir()
    with pytest.raises(new_plugin.NewPluginError, match=error):
        new_plugin.new_plugin(workspace, name)


def test_requirements_are_merged_with_the_union_driver(repo):
    attributes = git(repo, "check-attr", "merge", "--", "requirements-dev.txt")
    assert attributes == "requirements-dev.txt: merge: union"


def test_requirements_name_each_distribution_once(repo):
    """The union driver keeps both sides of a line that two stacks edited differently; this
    catches the leftover (two torch pins, ``-e ./core`` next to ``-e ./core[extra]``)."""
    names = []
    for line in (repo / "requirements-dev.txt").read_text().splitlines():
        requirement = line.split("#")[0].strip().removeprefix("-e ").strip()
        if requirement:
            names.append(re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower())
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, (
        f"requirements-dev.txt names {duplicates} more than once (a union merge of two edits "
        "of the same line): keep the right one"
    )
