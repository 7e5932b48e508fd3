"""The contributor workflow's pieces: commit-message rules, CI, the plugin template and
CONTRIBUTING.md's commands. The stack check is test_stack_check.py's; the whole workflow, end
to end against ghstack's fake GitHub, is test_ghstack_workflow.py's."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import check_commit_msg
import new_plugin
import pytest

SOURCE_ID = "ghstack-source-id: 6b1b8ea2c1d84e0c9c0f62a7bd64b3c3e58c9a0e"
PULL_REQUEST = "Pull-Request: https://github.com/plugtrain/plugtrain/pull/12"


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
        "Wipe the cache between runs",  # starts with "wip", is not one
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
        ("WIP: scaler", "a work-in-progress commit"),  # not a scope named "WIP"
        ("[WIP] scaler", "a work-in-progress commit"),  # not a lowercase subject
        ("(wip) scaler", "a work-in-progress commit"),
        ("grad_scaler: WIP skip steps", "a work-in-progress commit"),
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


@pytest.mark.parametrize("subject", ["WIP: scaler", "[WIP] scaler", "wip scaler"])
def test_a_work_in_progress_subject_gets_only_that_problem(subject):
    assert check_commit_msg.problems(subject) == [
        "a work-in-progress commit: finish it or squash it before submitting"
    ]


def test_checks_every_commit_of_a_range_and_names_the_bad_ones(scratch_repo, capsys, monkeypatch):
    base = scratch_repo.commit("Add a", {"a": "a"})
    bad = scratch_repo.commit("Added b.", {"b": "b"})
    scratch_repo.commit("Add c", {"c": "c"})
    monkeypatch.chdir(scratch_repo.path)
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
def test_new_plugin_is_the_template_renamed(repo, workspace, name):
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
            cwd=repo,
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


def test_requirements_are_merged_with_the_union_driver(repo, git):
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


# -- CI workflow, CONTRIBUTING.md, requirements --------------------------------------------


def test_ci_workflow_runs_readme_commands_on_every_pull_request(repo, readme_command):
    import yaml

    workflow = yaml.safe_load((repo / ".github" / "workflows" / "ci.yml").read_text())
    # NOTE: YAML 1.1 (PyYAML) reads the bare key `on` as the boolean True.
    triggers = workflow[True]
    assert set(triggers) == {"pull_request", "push"}
    # ghstack PRs target gh/<user>/<N>/base: any branch filter would skip them.
    assert not (triggers["pull_request"] or {}).keys() & {"branches", "branches-ignore"}
    assert triggers["push"] == {"branches": ["main"]}
    concurrency = workflow["concurrency"]
    assert "github.event.pull_request.number" in concurrency["group"]
    assert concurrency["cancel-in-progress"] == "${{ github.event_name == 'pull_request' }}"

    (job,) = workflow["jobs"].values()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    setup, test = readme_command(repo, "setup"), readme_command(repo, "test")
    assert setup in runs and test in runs and runs.index(setup) < runs.index(test)
    message_checks = [run for run in runs if run.startswith("python scripts/check_commit_msg.py")]
    assert len(message_checks) == 2  # pull requests and pushes to main
    checkout = next(
        step for step in job["steps"] if step.get("uses", "").startswith("actions/checkout")
    )
    assert checkout["with"]["fetch-depth"] == 0  # the PR's commits and ghstack's orig branches


def test_contributing_covers_the_workflow(repo, readme_command):
    text = (repo / "CONTRIBUTING.md").read_text()
    assert readme_command(repo, "setup") in text
    for needed in (
        "~/.ghstackrc",
        "ghstack submit",
        "ghstack land https://",
        "Merge button",
        'python -m pytest -m "not slow"',
        "python scripts/stack_check.py",
        "--no-cache",
        "python scripts/stack_check.py --install-hook",
        "python scripts/new_plugin.py",
    ):
        assert needed in text, needed


def test_the_ghstack_notes_keep_what_surprises_and_contributing_links_them(repo):
    """ghstack 0.18's surprises, read in its source; test_ghstack_workflow.py runs the flows."""
    notes = (repo / "docs" / "ghstack.md").read_text()
    words = " ".join(notes.split())  # whatever the line breaks
    for needed in (
        "ghstack checkout",
        "ghstack unlink",
        "git branch later",  # unready work waits on a branch
        "ghstack unlink HEAD",  # the way out of `ghstack submit HEAD~1`
        "per-user",
        "the variable is ignored",
        "git stash",
        "pushes straight to `main`",
        "allows force pushes",
        "does not fetch",
    ):
        assert needed in words, needed
    headings = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("# ").lower()).replace(" ", "-")
        for line in notes.splitlines()
        if line.startswith("## ")
    }
    links = re.findall(
        r"\(docs/ghstack\.md(?:#([\w-]+))?\)", (repo / "CONTRIBUTING.md").read_text()
    )
    assert links and {anchor for anchor in links if anchor} <= headings


def test_no_ghstackrc_is_committed_and_one_would_be_ignored(repo, git):
    assert not [f for f in git(repo, "ls-files").splitlines() if f.endswith(".ghstackrc")]
    assert git(repo, "check-ignore", "--no-index", ".ghstackrc") == ".ghstackrc"


def test_setup_command_installs_the_pinned_ghstack(repo):
    requirements = (repo / "requirements-dev.txt").read_text().splitlines()
    assert "ghstack==0.18.0" in requirements
    assert any(line.startswith("graphql-core") for line in requirements)
    assert any(line.startswith("pyyaml") for line in requirements)
    assert importlib.metadata.version("ghstack") == "0.18.0"
