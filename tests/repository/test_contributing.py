"""The contributor workflow's pieces: commit-message rules, CI, the plugin template, the
``pre-ghstack`` hook and the stack check (CONTRIBUTING.md). The whole workflow, end to end
against ghstack's fake GitHub, is in test_ghstack_workflow.py."""

from __future__ import annotations

import importlib.metadata
import os
import re
import stat
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import check_commit_msg
import new_plugin
import pytest
import stack_check

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


# -- the pre-ghstack hook ----------------------------------------------------------------


def test_install_hook_writes_the_pre_ghstack_hook_ghstack_runs(tmp_path):
    repo = make_repo(tmp_path / "repo")
    hook = stack_check.install_hook(repo, ["plugins", "-q"])
    assert hook == repo / ".git" / "hooks" / "pre-ghstack"
    assert hook.stat().st_mode & stat.S_IXUSR
    text = hook.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert 'scripts/stack_check.py" "$1" "$2" -- plugins -q' in text
    assert stack_check.install_hook(repo, ["-q"]) == hook  # ours: reinstalling replaces it
    assert '"$1" "$2" -- -q\n' in hook.read_text()

    hook.write_text("#!/bin/sh\nexit 0\n")  # someone else's hook is never overwritten
    with pytest.raises(stack_check.StackCheckError, match="exists and is not ours"):
        stack_check.install_hook(repo, ["-q"])


def test_install_hook_follows_core_hooks_path_and_refuses_linked_worktrees(tmp_path):
    repo = make_repo(tmp_path / "repo")
    commit(repo, "Add a", {"a": "a"})
    git(repo, "config", "core.hooksPath", "githooks")
    assert stack_check.install_hook(repo, []) == repo / "githooks" / "pre-ghstack"

    git(repo, "config", "--unset", "core.hooksPath")
    git(repo, "worktree", "add", "-q", str(tmp_path / "linked"))
    with pytest.raises(stack_check.StackCheckError, match="is a linked git worktree"):
        stack_check.install_hook(tmp_path / "linked", [])


def test_pythonpath_into_the_checkout_is_dropped(tmp_path, monkeypatch):
    inside, outside = tmp_path / "repo" / "core" / "src", tmp_path / "tools"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(inside), str(outside)]))
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "repo" / ".git"))
    env = stack_check.commit_environment(tmp_path / "repo")
    assert env["PYTHONPATH"] == str(outside)
    assert "GIT_DIR" not in env


def fake_distribution(site: Path, name: str, package: str, plugin: str = "") -> None:
    """A distribution installed in ``site``: a package, its metadata and RECORD."""
    info = site / f"{package}-1.0.dist-info"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text("")
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    files = [f"{package}/__init__.py", f"{info.name}/METADATA", f"{info.name}/RECORD"]
    if plugin:
        (info / "entry_points.txt").write_text(f"[plugtrain.plugins]\n{plugin} = {package}\n")
        files.append(f"{info.name}/entry_points.txt")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def test_environment_hides_the_outer_pythons_project_distributions(tmp_path, monkeypatch):
    """The core, plugtrain-* distributions and any plugtrain plugin installed where the
    check runs are invisible to the commit under test; everything else is reused."""
    outer = tmp_path / "outer" / "site-packages"
    fake_distribution(outer, "plugtrain", "plugtrain")
    fake_distribution(outer, "plugtrain-old-plugin", "plugtrain_old_plugin")
    fake_distribution(outer, "acme-clip", "acme_clip", plugin="acme_clip")
    fake_distribution(outer, "some-tool", "some_tool")
    monkeypatch.setattr(stack_check, "outer_site_dirs", lambda: [outer])
    env = stack_check.Environment(tmp_path / "venv", dict(os.environ))
    env.create()
    probe = (
        "import importlib.metadata as md, importlib.util as u;"
        "print(sorted(d.metadata['Name'] for d in md.distributions()));"
        "print([p for p in ('plugtrain', 'plugtrain_old_plugin', 'acme_clip', 'some_tool')"
        " if u.find_spec(p)])"
    )
    seen = subprocess.run(
        [env.python, "-c", probe], check=True, capture_output=True, text=True, env={}
    ).stdout.splitlines()
    assert seen == ["['some-tool']", "['some_tool']"]


# -- the stack check on a small synthetic repository --------------------------------------


@pytest.mark.slow
def test_stack_check_stops_at_the_first_failing_commit(tmp_path, capsys):
    """Three commits; the second breaks its test (so does the third): the check names the
    second and never runs the third. Each commit is tested as it is, not as HEAD is."""
    repo = make_repo(tmp_path / "repo")
    test = textwrap.dedent("""
        from pathlib import Path
        def test_value():
            assert Path("value.txt").read_text() == "{}"
    """)
    base = commit(repo, "Add the value test", {"value.txt": "1", "test_value.py": test.format(1)})
    commit(repo, "Change the value test", {"test_value.py": test.format(2)})
    second = git(repo, "rev-parse", "HEAD")
    commit(repo, "Change the value", {"value.txt": "3"})
    assert stack_check.check_stack(repo, base, "HEAD", ["-q", "-p", "no:cacheprovider"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED at [1/2] {second[:10]} 'Change the value test': tests failed" in out
    assert "[2/2]" not in out
    assert f"reproduce: git checkout {second[:10]} && python -m pytest -q" in out
    assert git(repo, "worktree", "list").count("\n") == 0  # the temporary worktree is gone

    commit(repo, "Fix the value test.", {"test_value.py": test.format(3)})
    assert stack_check.check_stack(repo, f"{second}~1", "HEAD", ["-q"]) == 1
    out = capsys.readouterr().out
    assert "the subject ends with a period" in out  # messages are checked before any test
    assert "[1/3]" not in out


def value_test(value: str) -> str:
    return textwrap.dedent(f"""
        from pathlib import Path
        def test_value():
            assert Path("value.txt").read_text() == "{value}"
    """)


def runs(out: str) -> list[str]:
    """The subjects of the commits the stack check ran pytest for, in order."""
    return re.findall(r"\[\d+/\d+\] [0-9a-f]{10} '([^']*)': python -m pytest", out)


@pytest.mark.slow
def test_stack_check_remembers_passing_trees(tmp_path, capsys):
    """An unchanged stack is not re-run; amending the top commit re-runs only it; a failure
    is never remembered; --no-cache runs everything."""
    repo = make_repo(tmp_path / "repo")
    base = commit(repo, "Add the value test", {"value.txt": "1", "test_value.py": value_test("1")})
    commit(repo, "Change the value", {"value.txt": "2", "test_value.py": value_test("2")})
    commit(repo, "Add a second test", {"test_other.py": "def test_other():\n    pass\n"})
    args = ["-q", "-p", "no:cacheprovider"]

    assert stack_check.check_stack(repo, base, "HEAD", args) == 0
    assert runs(capsys.readouterr().out) == ["Change the value", "Add a second test"]
    assert len(list((repo / ".git" / "plugtrain-stack-check").glob("*.json"))) == 2
    assert stack_check.check_stack(repo, base, "HEAD", args) == 0
    out = capsys.readouterr().out
    assert runs(out) == []
    assert out.count("passed before, not re-run") == 2
    assert "environment ready" not in out  # nothing to run: not even the environment

    commit(repo, "Add a second test", {"test_other.py": "def test_other():\n    assert 1\n"})
    git(repo, "reset", "-q", "--soft", "HEAD~1")
    git(repo, "commit", "-q", "--amend", "--no-edit")  # amend the top commit
    assert stack_check.check_stack(repo, base, "HEAD", args) == 0
    assert runs(capsys.readouterr().out) == ["Add a second test"]

    assert stack_check.check_stack(repo, base, "HEAD", ["-q", "-k", "value"]) == 0
    assert runs(capsys.readouterr().out) == ["Change the value", "Add a second test"]  # new args

    commit(repo, "Break the value", {"value.txt": "3"})
    for _ in range(2):  # a failure is not remembered
        assert stack_check.check_stack(repo, base, "HEAD", args) == 1
        assert runs(capsys.readouterr().out) == ["Break the value"]
    assert stack_check.check_stack(repo, base, "HEAD~1", args, use_cache=False) == 0
    assert runs(capsys.readouterr().out) == ["Change the value", "Add a second test"]


@pytest.fixture
def plugin_repo(tmp_path) -> Path:
    """A repository shaped like this one: a core, two plugins, tests, documentation."""
    repo = make_repo(tmp_path / "repo")
    commit(
        repo,
        "Import",
        {
            "core/src/plugtrain/__init__.py": "",
            "plugins/alpha/src/plugtrain_alpha/__init__.py": "",
            "plugins/alpha/tests/test_alpha.py": "",
            "plugins/beta/src/plugtrain_beta/__init__.py": "",
            "plugins/beta/tests/test_beta.py": "import plugtrain_alpha\n",
            "tests/test_hooks.py": "",
            "tests/test_manager.py": "",
            "tests/workers.py": "PLUGINS = ['alpha']\n",  # a helper module, not a test file
            "tests/test_distributed.py": "import workers\n",
            "tests/test_trainer.py": "",
            "tests/test_readme.py": "README = 'README.md'\n",
            "README.md": "# toy\n",
            "docs/guide.md": "guide\n",
            "requirements-dev.txt": "-e ./core\n-e ./plugins/alpha\n-e ./plugins/beta\n",
        },
    )
    return repo


def selection_after(repo: Path, files: dict[str, str], args: list[str] | None = None):
    commit(repo, "Change", files)
    args = ["-m", "not slow", "-q"] if args is None else args
    return stack_check.select_tests(repo, git(repo, "rev-parse", "HEAD"), args)


def test_stack_check_runs_a_plugin_commit_against_its_tests_and_the_contract(plugin_repo):
    selection = selection_after(plugin_repo, {"plugins/alpha/src/plugtrain_alpha/x.py": ""})
    assert selection.pytest_args == [
        "-m", "not slow", "-q",
        "plugins/alpha/tests",  # its own tests
        "tests/test_hooks.py", "tests/test_manager.py",  # the contract (test_repository absent)
        "plugins/beta/tests/test_beta.py",  # names plugtrain_alpha
        "tests/test_distributed.py",  # through tests/workers.py, which names alpha
    ]  # fmt: skip
    assert selection.reason.startswith("only plugins/alpha/ changed")
    # Explicit paths: the narrowed selection stays inside them.
    selection = selection_after(plugin_repo, {"plugins/alpha/x.txt": ""}, ["plugins", "-x"])
    assert selection.pytest_args == ["-x", "plugins/alpha/tests", "plugins/beta/tests/test_beta.py"]
    node = "tests/test_hooks.py::test_one"
    selection = selection_after(plugin_repo, {"plugins/alpha/x.txt": "1"}, [node, "-k", "tests"])
    assert selection.pytest_args == ["-k", "tests", node]
    selection = selection_after(
        plugin_repo, {"plugins/alpha/x.txt": "2"}, ["tests/test_trainer.py"]
    )
    assert selection.pytest_args is None
    assert "none of it in the given paths" in selection.reason


def test_stack_check_treats_a_new_plugin_with_its_requirements_line_as_plugin_only(plugin_repo):
    requirements = "-e ./core\n-e ./plugins/alpha\n-e ./plugins/beta\n-e ./plugins/gamma\n"
    selection = selection_after(
        plugin_repo,
        {"plugins/gamma/tests/test_gamma.py": "", "requirements-dev.txt": requirements},
    )
    assert selection.pytest_args == [
        "-m", "not slow", "-q", "plugins/gamma/tests", "tests/test_hooks.py",
        "tests/test_manager.py",
    ]  # fmt: skip
    # Any other requirements change can affect everything.
    selection = selection_after(
        plugin_repo,
        {"plugins/gamma/x.txt": "", "requirements-dev.txt": "torch==2.13.0\n" + requirements},
    )
    assert selection.pytest_args == ["-m", "not slow", "-q"]
    assert selection.reason == (
        "whole selection: it changes plugins/gamma/x.txt, requirements-dev.txt"
    )


def test_stack_check_runs_no_tests_for_documentation_nobody_tests(plugin_repo):
    selection = selection_after(plugin_repo, {"docs/guide.md": "new", "plugins/beta/README.md": ""})
    assert selection.pytest_args == ["-m", "not slow", "-q", "tests/test_readme.py"]  # README.md
    selection = selection_after(plugin_repo, {"docs/guide.md": "newer"})
    assert selection.pytest_args is None
    assert selection.reason == "documentation only (guide.md): no test reads it, no tests to run"
    for changed in (
        {"core/src/plugtrain/hooks.py": ""},
        {"plugins/alpha/a": "", "plugins/beta/b": ""},
    ):
        selection = selection_after(plugin_repo, changed)
        assert selection.pytest_args == ["-m", "not slow", "-q"]
        assert selection.reason.startswith("whole selection: it changes ")


def test_stack_check_prints_why_and_still_checks_messages_of_untested_commits(plugin_repo, capsys):
    base = git(plugin_repo, "rev-parse", "HEAD")
    commit(plugin_repo, "Reword the guide", {"docs/guide.md": "reworded"})
    assert stack_check.check_stack(plugin_repo, base, "HEAD", ["-q"]) == 0
    out = capsys.readouterr().out
    assert "no test reads it, no tests to run" in out and "all 1 commits pass (1 no tests" in out
    commit(plugin_repo, "Updated the guide", {"docs/guide.md": "again"})
    assert stack_check.check_stack(plugin_repo, base, "HEAD", ["-q"]) == 1
    assert "the subject starts with 'Updated'" in capsys.readouterr().out


def test_stack_check_names_a_pytest_path_the_commit_lacks(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    base = commit(repo, "Add a", {"a": "a"})
    sha = commit(repo, "Add the value test", {"tests/test_value.py": value_test("1")})
    args = ["-q", "tests/test_value.py::test_value", "plugins/grad_clip", "-k", "not_a_path"]
    assert stack_check.check_stack(repo, base, "HEAD", args) == 1
    out = capsys.readouterr().out
    assert (
        f"FAILED at [1/1] {sha[:10]} 'Add the value test': no such path in this commit: "
        "plugins/grad_clip (a pytest path given to the check or to --install-hook"
    ) in out
    assert "tests failed" not in out and "environment ready" not in out


@pytest.mark.parametrize(
    ("args", "options", "paths"),
    [
        (["-m", "not slow", "-q", "-x"], ["-m", "not slow", "-q", "-x"], []),
        (["plugins", "-k", "toy or x", "tests/a.py::t"],
         ["-k", "toy or x"], ["plugins", "tests/a.py::t"]),
        (["--tb=short", "-p", "no:cacheprovider", "--", "-odd"],
         ["--tb=short", "-p", "no:cacheprovider"], ["-odd"]),
    ],
)  # fmt: skip
def test_pytest_arguments_are_split_into_options_and_paths(args, options, paths):
    assert stack_check.split_pytest_args(args) == (options, paths)


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
        "ghstack submit",
        "ghstack checkout",
        "ghstack land https://",
        "ghstack unlink",
        "git branch later",  # unready work waits on a branch (test_ghstack_workflow.py)
        "ghstack unlink HEAD",  # the way out of `ghstack submit HEAD~1`
        # ghstack 0.18 facts that surprise (read in its source, see the commit adding them)
        "per-user",
        "the variable is ignored",
        "git stash",
        "pushes straight to `main`",
        "allows force pushes",
        "does not fetch",
        # the stack check's memory and narrowing, with the measured saving
        ".git/plugtrain-stack-check/",
        "--no-cache",
        "python scripts/stack_check.py HEAD~2 HEAD --",
        "Merge button",
        "~/.ghstackrc",
        "python scripts/stack_check.py --install-hook",
        "python scripts/new_plugin.py",
        'python -m pytest -m "not slow"',
    ):
        assert needed in text, needed


def test_no_ghstackrc_is_committed_and_one_would_be_ignored(repo):
    assert not [f for f in git(repo, "ls-files").splitlines() if f.endswith(".ghstackrc")]
    assert git(repo, "check-ignore", "--no-index", ".ghstackrc") == ".ghstackrc"


def test_setup_command_installs_the_pinned_ghstack(repo):
    requirements = (repo / "requirements-dev.txt").read_text().splitlines()
    assert "ghstack==0.18.0" in requirements
    assert any(line.startswith("graphql-core") for line in requirements)
    assert any(line.startswith("pyyaml") for line in requirements)
    assert importlib.metadata.version("ghstack") == "0.18.0"
