"""The contributor workflow of CONTRIBUTING.md, end to end and offline.

"GitHub" is ghstack's own fake (``ghstack.github_fake.FakeGitHubEndpoint``) over a local bare
repository that plays ``origin``; ghstack 0.18's ``submit`` and ``land`` run in-process on
clones of it, exactly as its CLI would call them. The repository is a copy of this one (its
tracked and unignored files, less the shipped plugins, which the selection does not test), so
the stack check, the plugin template and the tests that run are the real ones. Any attempt to
open a network connection, in this process or in any Python subprocess (the pre-ghstack hook,
pip, pytest), fails the test.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import ghstack.github_fake  # needs graphql-core (see requirements-dev.txt)
import ghstack.land
import ghstack.shell
import ghstack.submit
import ghstack.unlink
import pytest
import stack_check

OWNER = NAME = "plugtrain"
SELECTION = ["-m", "not slow", "-q", "-x", "-p", "no:cacheprovider",
             "-k", "toy or (test_repository and not ruff)", "-o", "python_files=test_toy_*.py",
             "-p", "plugtrain.testing.pytest_plugin", "-p", "xdist.plugin", "-n", "0",
             "tests/repository/test_repository.py", "plugins"]  # fmt: skip
"""The hook's pytest selection: the toy plugins' own tests and the repository's rules (every
plugin folder is a distribution listed in requirements-dev.txt...). Not ruff: a lint error
in the working tree being copied is test_repository's to report, not this test's. Explicit
paths, and only the toy plugins' test files under plugins/: collecting the whole tree (torch,
every plugin's tests) would cost each checked commit some 15 s for the same selection. The
test turns pytest's plugin autoloading off: of the installed plugins (hypothesis, anyio...,
seconds of imports) the selection needs only the kit's, named here, and xdist's, for the
addopts' ``-n``: turned off, as workers would cost more than this selection takes."""

GUARD = textwrap.dedent('''
    """Refuse network connections (Unix sockets only), in the test's process and, as the
    sitecustomize of every Python subprocess, in those."""
    import socket


    def install(patch, refuse):
        connect = socket.socket.connect

        def connect_local_only(self, address):
            if self.family != socket.AF_UNIX:
                refuse(address)
            return connect(self, address)

        patch(socket.socket, "connect", connect_local_only)
        patch(socket.socket, "connect_ex", connect_local_only)
        patch(socket, "create_connection", refuse)
        patch(socket, "getaddrinfo", refuse)
''')

SITECUSTOMIZE = GUARD + textwrap.dedent("""
    import os


    def _refuse(*args, **kwargs):
        with open(os.environ["NO_NETWORK_LOG"], "a") as log:
            log.write(f"network access in pid {os.getpid()}: {args!r}\\n")
        raise OSError("network access in an offline test")


    install(setattr, _refuse)
""")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network: in this process (socket patched) and in every Python subprocess (a
    sitecustomize on PYTHONPATH); git gets a private config with a committer identity."""
    guard = tmp_path / "no_network"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "network.log"
    monkeypatch.setenv("NO_NETWORK_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(guard))
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in an offline test")

    guard_module: dict = {}
    exec(GUARD, guard_module)
    guard_module["install"](monkeypatch.setattr, refuse)

    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(
        "[user]\n\tname = Test Contributor\n\temail = contributor@example.com\n"
        "[advice]\n\tdetachedHead = false\n[init]\n\tdefaultBranch = main\n"
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")

    # The guard works: a subprocess that connects fails, and the attempt is logged.
    probe = "import socket; socket.create_connection(('127.0.0.1', 9))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode != 0
    assert "network access in pid" in log.read_text()
    log.unlink()
    with pytest.raises(OSError, match="offline"):
        socket.create_connection(("127.0.0.1", 9))
    attempts.clear()
    yield
    assert attempts == []
    assert not log.exists(), log.read_text()


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def run_script(cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"scripts/{script}", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )


class FakeGitHub:
    """ghstack's fake GitHub over the bare repository ``origin``, serving one repository."""

    def __init__(self, origin: Path) -> None:
        self.origin = origin
        self.endpoint = ghstack.github_fake.FakeGitHubEndpoint(ghstack.shell.Shell(cwd=str(origin)))
        # NOTE: out of the box the fake serves only pytorch/pytorch; registering another
        # repository sets its private counters (ghstack is pinned to 0.18.0 for this).
        state = self.endpoint.state
        repo_id = state.next_id()
        repository = ghstack.github_fake.Repository(
            id=repo_id,
            name=NAME,
            nameWithOwner=f"{OWNER}/{NAME}",
            isFork=False,
            defaultBranchRef=None,
        )
        state.repositories[repo_id] = repository
        state._next_pull_request_number[repo_id] = 1
        state._next_issue_comment_full_database_id[repo_id] = 1
        self.repository = repository
        asyncio.run(self._set_default_branch())

    async def _set_default_branch(self) -> None:
        state = self.endpoint.state
        self.repository.defaultBranchRef = await self.repository._make_ref_async(state, "main")

    def submit(self, clone: Path, username: str, *revs: str) -> list[str]:
        """``ghstack submit [REV...]`` in ``clone``; the URLs of its pull requests, bottom
        first."""
        diffs = asyncio.run(
            ghstack.submit.main(
                msg="Update",
                username=username,
                github=self.endpoint,
                sh=ghstack.shell.Shell(cwd=str(clone)),
                repo_owner_opt=OWNER,
                repo_name_opt=NAME,
                github_url="github.com",
                remote_name="origin",
                direct_opt=False,
                revs=list(revs),
            )
        )
        return [diff.pr_url for diff in diffs]

    def land(self, clone: Path, url: str) -> None:
        """``ghstack land <url>`` from ``clone``."""
        asyncio.run(
            ghstack.land.main(
                pull_request=url,
                remote_name="origin",
                github=self.endpoint,
                sh=ghstack.shell.Shell(cwd=str(clone)),
                github_url="github.com",
            )
        )

    def closed(self) -> dict[int, bool]:
        return {pr.number: pr.closed for pr in self.endpoint.state.pull_requests.values()}

    def refs(self) -> str:
        return git(self.origin, "for-each-ref")

    def main_log(self) -> list[str]:
        """``main``'s subjects, oldest first."""
        return git(self.origin, "log", "--reverse", "--format=%s", "main").splitlines()


def contributor(origin: Path, folder: Path, *, hook: bool) -> Path:
    git(folder.parent, "clone", "-q", str(origin), folder.name)
    if hook:  # CONTRIBUTING.md's one command, with the selection this test can afford
        run_script(folder, "stack_check.py", "--install-hook", "--", *SELECTION)
    return folder


def add_plugin(clone: Path, name: str) -> str:
    """Make plugins/<name> from the template, as CONTRIBUTING.md says, and commit it."""
    run_script(clone, "new_plugin.py", name)
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", f"Add the {name} plugin")
    return git(clone, "rev-parse", "HEAD")


@pytest.mark.slow
def test_stacks_are_checked_submitted_and_landed(
    repository_copy, tmp_path, offline, capsys, monkeypatch
):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # for the hook's pytest runs
    seed = tmp_path / "seed"
    repository_copy(seed, plugins=())  # each checked commit would install every plugin
    git(seed, "init", "-q")
    git(seed, "add", "-A")
    git(seed, "commit", "-q", "-m", "Import plugtrain")
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(seed, "push", "-q", str(origin), "main")
    github = FakeGitHub(origin)

    # 1. The pre-ghstack hook refuses a stack whose first commit breaks a test: a plugin
    #    folder missing from requirements-dev.txt. Nothing is pushed, nothing is rewritten.
    dave = contributor(origin, tmp_path / "dave", hook=True)
    run_script(dave, "new_plugin.py", "toy_broken")
    git(dave, "checkout", "requirements-dev.txt")
    git(dave, "add", "-A")
    git(dave, "commit", "-q", "-m", "Add the toy_broken plugin")
    add_plugin(dave, "toy_fine")
    head, refs = git(dave, "rev-parse", "HEAD"), github.refs()
    with pytest.raises(RuntimeError, match=r"pre-ghstack origin/main [0-9a-f]{40} failed"):
        github.submit(dave, "dave")
    out = capsys.readouterr().out
    assert "FAILED at [1/2]" in out and "'Add the toy_broken plugin': tests failed" in out
    assert "test_every_plugin_folder_is_a_distribution_with_tests" in out
    assert github.refs() == refs and github.closed() == {}
    assert git(dave, "rev-parse", "HEAD") == head

    # 2. Alice's stack of two independent plugins passes the hook and becomes PRs #1 and #2.
    alice = contributor(origin, tmp_path / "alice", hook=True)
    add_plugin(alice, "toy_clip")
    add_plugin(alice, "toy_scaler")
    clip_pr, scaler_pr = github.submit(alice, "alice")
    out = capsys.readouterr().out
    for index, subject in enumerate(["Add the toy_clip plugin", "Add the toy_scaler plugin"], 1):
        assert f"[{index}/2]" in out and f"'{subject}': passed" in out
    assert "all 2 commits pass" in out
    assert (clip_pr, scaler_pr) == tuple(
        f"https://github.com/{OWNER}/{NAME}/pull/{n}" for n in (1, 2)
    )
    stack = git(alice, "log", "--reverse", "--format=%T %s", "origin/main..HEAD").splitlines()
    assert [line.split(" ", 1)[1] for line in stack] == [
        "Add the toy_clip plugin",
        "Add the toy_scaler plugin",
    ]
    checked_trees = [line.split()[0] for line in stack]  # the trees the hook passed
    for n in (1, 2):
        assert f"refs/heads/gh/alice/{n}/orig" in github.refs()

    # 3. Bob, meanwhile, adds a plugin of his own: PR #3, on the same main.
    bob = contributor(origin, tmp_path / "bob", hook=False)
    add_plugin(bob, "toy_stats")
    (stats_pr,) = github.submit(bob, "bob")

    # 4. Landing the bottom PR lands only it: main is the commit the hook checked by itself.
    github.land(alice, clip_pr)
    assert github.main_log() == ["Import plugtrain", "Add the toy_clip plugin (#1)"]
    assert git(origin, "rev-parse", "main^{tree}") == checked_trees[0]
    assert github.closed() == {1: True, 2: False, 3: False}

    # 5. Landing the top PR lands the rest of the stack, then Bob's PR lands on top of it:
    #    plugins in their own folders do not conflict (requirements-dev.txt merges by union).
    github.land(alice, scaler_pr)
    assert git(origin, "rev-parse", "main^{tree}") == checked_trees[1]
    github.land(bob, stats_pr)
    assert github.main_log() == [
        "Import plugtrain",
        "Add the toy_clip plugin (#1)",
        "Add the toy_scaler plugin (#2)",
        "Add the toy_stats plugin (#3)",
    ]
    assert github.closed() == {1: True, 2: True, 3: True}
    assert "gh/" not in github.refs()  # land deletes the stacks' branches

    # 6. A land that conflicts with main stops and leaves main untouched.
    carol = contributor(origin, tmp_path / "carol", hook=False)
    readme = carol / "README.md"
    readme.write_text(readme.read_text().replace("# plugtrain", "# plugtrain, by Carol", 1))
    git(carol, "commit", "-q", "-am", "Retitle the README")
    (carol_pr,) = github.submit(carol, "carol")
    git(seed, "pull", "-q", str(origin), "main")
    readme = seed / "README.md"
    readme.write_text(readme.read_text().replace("# plugtrain", "# plugtrain, by Dan", 1))
    git(seed, "commit", "-q", "-am", "Retitle the README differently")
    git(seed, "push", "-q", str(origin), "main")
    main_before = git(origin, "rev-parse", "main")
    with pytest.raises(RuntimeError, match="cherry-pick"):
        github.land(carol, carol_pr)
    assert git(origin, "rev-parse", "main") == main_before
    assert github.closed()[4] is False
    assert "refs/heads/gh/carol/1/orig" in github.refs()

    # 7. The landed plugins install from main's tree and are found through their entry points.
    landed = tmp_path / "landed"
    git(tmp_path, "clone", "-q", str(origin), landed.name)
    env = stack_check.Environment(tmp_path / "venv", stack_check.commit_environment(landed))
    env.create()
    env.sync(landed)
    assert {"core", "toy_clip", "toy_scaler", "toy_stats"} <= {f.name for f in env.installed}
    listing = subprocess.run(
        [str(env.root / "bin" / "plugtrain"), "plugins", "--plugins.enabled",
         "toy_clip,toy_scaler,toy_stats"],
        cwd=landed, check=True, capture_output=True, text=True, env=env.env,
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line for line in listing.splitlines() if line.strip()}
    for name in ("toy_clip", "toy_scaler", "toy_stats"):
        distribution = "plugtrain-" + name.replace("_", "-")
        assert rows[name].split()[1:4] == ["yes", distribution, "0.1.0"], listing
        assert "post_backward" in rows[name], listing  # imported through its entry point
    # Exactly main's plugins: none leaks in from the Python running this test.
    assert set(rows) - {"plugin"} == {folder.name for folder in (landed / "plugins").iterdir()}


RECORDING_HOOK = """#!/bin/sh
# What the pre-ghstack hook was asked to check: the subjects in <base>..<top>.
git log --reverse --format=%s "$1..$2" | tr '\\n' '|' >> "$(git rev-parse --git-dir)/checked"
echo >> "$(git rev-parse --git-dir)/checked"
"""


def hooked_clone(origin: Path, folder: Path) -> Path:
    """A clone on branch ``stack`` whose pre-ghstack hook records what it is asked to check."""
    git(folder.parent, "clone", "-q", str(origin), folder.name)
    git(folder, "checkout", "-q", "-b", "stack")
    hook = folder / ".git" / "hooks" / "pre-ghstack"
    hook.write_text(RECORDING_HOOK)
    hook.chmod(0o755)
    return folder


def checked(clone: Path) -> list[str]:
    """Each hook run: the subjects it checked, joined by '|'."""
    record = clone / ".git" / "checked"
    lines = record.read_text().splitlines() if record.exists() else []
    record.unlink(missing_ok=True)
    return [line.rstrip("|") for line in lines]


def commit_file(clone: Path, name: str) -> None:
    (clone / name).write_text(name)
    git(clone, "add", name)
    git(clone, "commit", "-q", "-m", f"Add {name}")


def unlink(github: FakeGitHub, clone: Path, commits: list[str]) -> None:
    """``ghstack unlink COMMIT...`` in ``clone``."""
    asyncio.run(
        ghstack.unlink.main(
            commits=commits,
            github=github.endpoint,
            sh=ghstack.shell.Shell(cwd=str(clone)),
            repo_owner=OWNER,
            repo_name=NAME,
            github_url="github.com",
            remote_name="origin",
        )
    )


@pytest.mark.slow
def test_unready_work_waits_on_another_branch(tmp_path, offline):
    """docs/ghstack.md's flow for holding back unready work, and why not `ghstack submit
    HEAD~1`: in ghstack 0.18 that opens a pull request for the held-back commit anyway,
    unchecked by the hook and without its orig branch, and the next submit fails."""
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "README.md").write_text("# toy\n")
    git(seed, "init", "-q")
    git(seed, "add", "-A")
    git(seed, "commit", "-q", "-m", "Import")
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(seed, "push", "-q", str(origin), "main")
    github = FakeGitHub(origin)

    # The recommended flow: park the unready commit on a branch, submit the rest.
    alice = hooked_clone(origin, tmp_path / "alice")
    commit_file(alice, "ready")
    commit_file(alice, "unready")
    git(alice, "branch", "later")
    git(alice, "reset", "-q", "--hard", "HEAD~1")
    assert github.submit(alice, "alice") == [f"https://github.com/{OWNER}/{NAME}/pull/1"]
    assert checked(alice) == ["Add ready"]
    assert set(github.closed()) == {1}
    # Later: put the unready work back on top of the submitted commit (which now has
    # ghstack's trailers; the rebase drops the old copy) and submit the whole stack.
    git(alice, "checkout", "-q", "later")
    git(alice, "rebase", "-q", "stack")
    stack = git(alice, "log", "--reverse", "--format=%s%n%b%x00", "origin/main..HEAD")
    ready, unready = (entry.strip() for entry in stack.split("\0") if entry.strip())
    assert ready.startswith("Add ready") and ready.endswith("/pull/1")
    assert unready == "Add unready"
    urls = github.submit(alice, "alice")
    assert urls == [f"https://github.com/{OWNER}/{NAME}/pull/{n}" for n in (1, 2)]
    assert checked(alice) == ["Add ready|Add unready"]
    assert github.submit(alice, "alice") == urls  # and again: nothing is missing
    for n in (1, 2):
        assert f"refs/heads/gh/alice/{n}/orig" in github.refs()

    # The broken advice: `ghstack submit HEAD~1` (ghstack 0.18).
    bob = hooked_clone(origin, tmp_path / "bob")
    commit_file(bob, "ready2")
    commit_file(bob, "unready2")
    pulls = github.endpoint.state.pull_requests
    assert github.submit(bob, "bob", "HEAD~1") == [f"https://github.com/{OWNER}/{NAME}/pull/3"]
    assert checked(bob) == ["Add ready2"]  # the hook never saw the held-back commit...
    assert {pr.number: pr.title for pr in pulls.values()}[4] == "Add unready2"  # ...yet a PR
    assert "gh/bob/2/head" in github.refs() and "gh/bob/2/orig" not in github.refs()
    with pytest.raises(RuntimeError, match=r"rev-list .*origin/gh/bob/2/orig failed"):
        github.submit(bob, "bob")

    # Recovery: close the stray pull request (on GitHub), unlink the held-back commit, park it
    # on a branch; the stack submits again, and the unready commit later gets a new PR.
    next(pr for pr in pulls.values() if pr.number == 4).closed = True
    unlink(github, bob, ["HEAD"])
    assert "Pull-Request:" not in git(bob, "log", "-1", "--format=%B")
    git(bob, "branch", "later")
    git(bob, "reset", "-q", "--hard", "HEAD~1")
    assert github.submit(bob, "bob") == [f"https://github.com/{OWNER}/{NAME}/pull/3"]
    git(bob, "checkout", "-q", "later")
    git(bob, "rebase", "-q", "stack")
    urls = github.submit(bob, "bob")
    assert urls == [f"https://github.com/{OWNER}/{NAME}/pull/{n}" for n in (3, 5)]
    # <N> in gh/<user>/<N>/... is ghstack's per-user counter, not the pull request's number.
    assert "refs/heads/gh/bob/3/orig" in github.refs()
    assert "gh/bob/5" not in github.refs()
