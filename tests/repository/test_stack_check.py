"""scripts/stack_check.py: messages first, then each commit alone in a worktree, remembered
when it passed, with pytest's arguments passed through untouched."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest
import stack_check

ARGS = ["-q", "-p", "no:cacheprovider"]


def value_test(value: str) -> str:
    return textwrap.dedent(f"""
        from pathlib import Path
        def test_value():
            assert Path("value.txt").read_text() == "{value}"
    """)


@pytest.fixture
def bare_pytest(monkeypatch):
    """The stack check's pytest runs load no plugins from entry points: the scratch tests need
    none, and importing them (plugtrain's imports torch) would cost seconds a run."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def runs(out: str) -> list[str]:
    """The subjects of the commits the stack check ran pytest for, in order."""
    return re.findall(r"\[\d+/\d+\] [0-9a-f]{10} '([^']*)': python -m pytest", out)


def test_messages_are_checked_before_any_commit_runs(scratch_repo, capsys):
    base = scratch_repo.commit("Add the value test", {"value.txt": "1"})
    scratch_repo.commit("Updated the value.", {"value.txt": "2"})
    assert stack_check.check_stack(scratch_repo.path, base, "HEAD", ARGS) == 1
    out = capsys.readouterr().out
    assert "the subject ends with a period" in out
    assert "the subject starts with 'Updated'" in out
    assert "FAILED: fix the messages" in out and runs(out) == []


@pytest.mark.slow
def test_each_commit_runs_alone_and_the_check_stops_at_the_first_failure(
    scratch_repo, capfd, bare_pytest
):
    """Each commit is tested as it is, not as HEAD is; the third is never run; the temporary
    worktree is gone afterwards; a failure is not remembered."""
    repo = scratch_repo
    base = repo.commit("Add the value test", {"value.txt": "1", "test_value.py": value_test(1)})
    second = repo.commit("Change the value test", {"test_value.py": value_test(2)})
    repo.commit("Change the value", {"value.txt": "2"})
    for _ in range(2):
        assert stack_check.check_stack(repo.path, base, "HEAD", ARGS) == 1
        out = capfd.readouterr().out
        assert runs(out) == ["Change the value test"]
        assert f"FAILED at [1/2] {second[:10]} 'Change the value test': tests failed" in out
        assert f"reproduce: git checkout {second[:10]} && python -m pytest -q" in out
        assert "1 failed" in out  # pytest's own report
    assert repo.git("worktree", "list").count("\n") == 0


@pytest.mark.slow
def test_passing_trees_are_remembered(scratch_repo, capfd, bare_pytest):
    """An unchanged stack is not re-run; amending the top commit re-runs only it; other
    pytest arguments run again; --no-cache runs everything."""
    repo = scratch_repo
    base = repo.commit("Add the value test", {"value.txt": "1", "test_value.py": value_test(1)})
    repo.commit("Change the value", {"value.txt": "2", "test_value.py": value_test(2)})
    repo.commit("Add a second test", {"test_other.py": "def test_other():\n    pass\n"})
    assert stack_check.check_stack(repo.path, base, "HEAD", ARGS) == 0
    assert runs(capfd.readouterr().out) == ["Change the value", "Add a second test"]
    assert stack_check.check_stack(repo.path, base, "HEAD", ARGS) == 0
    out = capfd.readouterr().out
    assert runs(out) == [] and out.count("passed before with the same tree, not re-run") == 2

    (repo.path / "test_other.py").write_text("def test_other():\n    assert 1\n")
    repo.git("commit", "-q", "-a", "--amend", "--no-edit")
    assert stack_check.check_stack(repo.path, base, "HEAD", ARGS) == 0
    assert runs(capfd.readouterr().out) == ["Add a second test"]
    assert stack_check.check_stack(repo.path, base, "HEAD", [*ARGS, "-k", "value"]) == 0
    assert runs(capfd.readouterr().out) == ["Change the value", "Add a second test"]
    assert stack_check.check_stack(repo.path, base, "HEAD", ARGS, use_cache=False) == 0
    assert runs(capfd.readouterr().out) == ["Change the value", "Add a second test"]


@pytest.mark.slow
def test_a_plugin_commit_importing_core_internals_fails_the_default_selection(
    repository_copy, git, tmp_path, capfd
):
    """The default selection is the whole fast suite for every commit, so the architecture
    test, which keeps plugins to the plugin API, runs on a commit that changes one plugin.
    Serially (``-n 0``: the same tests, in file order, up to the first failure): workers would
    each collect the whole suite again. The copy holds the one plugin and, of the core's
    tests, the architecture test alone: the default selection finds it wherever it sits, and
    every other plugin and test would cost an install or an import of its own (some 40 s)."""
    copy = tmp_path / "copy"
    repository_copy(copy, plugins=["grad_clip"])
    for entry in (copy / "tests").iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        elif entry.name not in ("conftest.py", "test_architecture.py"):
            entry.unlink()
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "Import"]):
        git(copy, "-c", "user.name=T", "-c", "user.email=t@example.com", *args)
    leak = copy / "plugins" / "grad_clip" / "src" / "plugtrain_grad_clip" / "leak.py"
    leak.write_text(
        '"""Reaches into the core."""\n\nfrom plugtrain.config import ModelConfig\n\n'
        '__all__ = ["ModelConfig"]\n'
    )
    git(copy, "add", "-A")
    git(copy, "-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "Leak")
    args = [*stack_check.DEFAULT_PYTEST_ARGS, "-n", "0"]
    assert stack_check.check_stack(copy, "HEAD~1", "HEAD", args, use_cache=False) == 1
    out = capfd.readouterr().out
    assert "FAILED at [1/1]" in out and "'Leak': tests failed" in out
    assert "FAILED tests/test_architecture.py::test_plugins_and_their_tests_import_only" in out


def test_arguments_after_the_double_dash_go_to_pytest_untouched(scratch_repo, monkeypatch):
    monkeypatch.chdir(scratch_repo.path)
    assert stack_check.main(["--install-hook"]) == 0
    hook = scratch_repo.path / ".git" / "hooks" / "pre-ghstack"
    assert hook.read_text().endswith('"$1" "$2" -- -m \'not slow\' -q -x\n')  # the default
    assert stack_check.main(["--install-hook", "--", "-k", "a or b", "--", "x y"]) == 0
    assert hook.read_text().endswith("\"$1\" \"$2\" -- -k 'a or b' -- 'x y'\n")


def test_install_hook_writes_the_pre_ghstack_hook_ghstack_runs(scratch_repo):
    repo = scratch_repo.path
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


def test_install_hook_follows_core_hooks_path_and_refuses_linked_worktrees(scratch_repo):
    scratch_repo.commit("Add a", {"a": "a"})
    scratch_repo.git("config", "core.hooksPath", "githooks")
    assert stack_check.install_hook(scratch_repo.path, []) == (
        scratch_repo.path / "githooks" / "pre-ghstack"
    )
    scratch_repo.git("config", "--unset", "core.hooksPath")
    linked = scratch_repo.path.parent / "linked"
    scratch_repo.git("worktree", "add", "-q", str(linked))
    with pytest.raises(stack_check.StackCheckError, match="is a linked git worktree"):
        stack_check.install_hook(linked, [])


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
