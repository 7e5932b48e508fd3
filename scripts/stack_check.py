"""Test each commit of a local stack on its own, before ``ghstack submit`` (CONTRIBUTING.md).

Every pull request of a ghstack stack is reviewed, tested and landed as one commit, so every
commit must pass the tests by itself, not only the top of the stack. For the commits in
``BASE..TOP``, oldest first, this script

1. checks every commit message (``scripts/check_commit_msg.py``'s rules), then
2. checks each commit out in a temporary ``git worktree``, installs that commit's ``core/``
   and ``plugins/*`` (editable, without dependencies) into a throwaway virtual environment,
   and runs the fast test selection there,

and stops at the first commit that fails, naming it. Your working tree is never touched.

Two things keep a re-run cheap (``--no-cache`` turns the first off):

- **Results are remembered.** A commit whose tree and pytest arguments already passed is not
  run again: the passes are recorded under ``<git dir>/plugtrain-stack-check/``, keyed by the
  tree hash, the arguments and the Python running the check. Amending the top commit re-runs
  only it; amending a lower one re-runs it and those above it (their trees changed too).
- **Each commit runs what it can affect.** A commit that changes files of one plugin only
  (``plugins/<name>/``, plus its own ``-e ./plugins/<name>`` line in requirements-dev.txt)
  runs that plugin's tests, the core's contract tests (:data:`CORE_CONTRACT_TESTS`) and every
  test file that names the plugin. A commit that changes documentation only (``*.md``,
  ``docs/``) runs only the test files that name a changed document (often none); its message
  is still checked. Any other commit runs the whole selection. When you give paths, the
  narrowed selection stays inside them. Each commit's line says why it runs what it runs.

Usage, from anywhere in the repository::

    python scripts/stack_check.py                       # origin/main..HEAD
    python scripts/stack_check.py main HEAD~1           # BASE TOP
    python scripts/stack_check.py -- plugins -q -x      # another pytest selection
    python scripts/stack_check.py --install-hook        # run it before every `ghstack submit`

``--install-hook`` writes the ``pre-ghstack`` git hook: ghstack 0.18 runs
``<hooks path>/pre-ghstack <base commit> <top commit>`` (``<hooks path>`` is
``core.hooksPath``, else ``<top level>/.git/hooks``) before it pushes anything, and refuses to
submit when the hook fails. Arguments after ``--`` at install time are baked into the hook.

The throwaway environment: a virtual environment whose packages are those of the Python that
runs this script (torch, pytest, ... are reused, not reinstalled), except the project's own
distributions (``plugtrain``, ``plugtrain-*`` and any ``plugtrain.plugins`` entry point),
which would otherwise shadow the commit's: each commit sees exactly its own core and
plugins, discovered through their entry points. It costs about a second per distribution
the first time, and only for changed ones after that.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import venv
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_commit_msg, when imported
from check_commit_msg import problems

DEFAULT_BASE = "origin/main"
DEFAULT_PYTEST_ARGS = ["-m", "not slow", "-q", "-x"]
"""The fast selection: every test not marked slow; stop at the first failure."""

CORE_CONTRACT_TESTS = ("tests/test_hooks.py", "tests/test_manager.py", "tests/test_repository.py")
"""What a plugin-only commit runs besides its plugin's tests: the hook contract, the plugin
manager, and the repository's rules (plugin folders, requirements-dev.txt, ruff); fast."""

CACHE_FOLDER = "plugtrain-stack-check"
"""Under git's common dir (shared by every worktree of the clone): one file per passing run."""

CACHE_VERSION = 1
"""Part of every cache key: bump it when what a key stands for changes."""

# pytest options whose value is the next argument: that argument is not a path.
PYTEST_OPTIONS_WITH_VALUE = frozenset(
    {
        "-k",
        "-m",
        "-p",
        "-c",
        "-o",
        "-W",
        "-r",
        "--tb",
        "--deselect",
        "--ignore",
        "--ignore-glob",
        "--rootdir",
        "--basetemp",
        "--confcutdir",
        "--durations",
        "--maxfail",
        "--junitxml",
        "--junit-xml",
        "--log-level",
        "--import-mode",
        "--capture",
        "--override-ini",
        "--log-file",
        "--cov",
        "--cov-report",
    }
)

PLUGIN_GROUP = "plugtrain.plugins"
HOOK_MARKER = "installed by scripts/stack_check.py --install-hook"

# Variables that would point git at another repository or index than the worktree's.
GIT_LOCATION_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_PREFIX")


class StackCheckError(Exception):
    """Bad input or a broken environment: one line saying what and how to fix it."""


def git(*args: str, cwd: Path) -> str:
    """Run git in ``cwd``; return its stripped stdout, or raise with git's message."""
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise StackCheckError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


def commit_environment(toplevel: Path) -> dict[str, str]:
    """The environment pip and pytest run in: this process's, minus what would make a commit
    see other code than its own.

    ``PYTHONPATH`` entries inside the repository (a checkout's ``core/src``) would shadow the
    commit's code and are dropped; other entries are kept. So are git's location variables,
    set when git itself runs the script as a hook.
    """
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    if "PYTHONPATH" in env:
        kept = [
            entry
            for entry in env["PYTHONPATH"].split(os.pathsep)
            if entry and not Path(entry).resolve().is_relative_to(toplevel.resolve())
        ]
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


@dataclass(frozen=True)
class Commit:
    sha: str
    message: str

    @property
    def subject(self) -> str:
        return self.message.strip().splitlines()[0] if self.message.strip() else ""

    def __str__(self) -> str:
        return f"{self.sha[:10]} {self.subject!r}"


def stack_commits(repo: Path, base: str, top: str) -> list[Commit]:
    """The commits in ``base..top``, oldest first."""
    out = git("log", "--reverse", "-z", "--format=%H%n%B", f"{base}..{top}", "--", cwd=repo)
    commits = []
    for record in filter(str.strip, out.split("\0")):
        sha, _, message = record.lstrip("\n").partition("\n")
        commits.append(Commit(sha, message))
    return commits


def distributions_at(tree: Path) -> dict[Path, str]:
    """The distributions a checkout holds (``core/`` and ``plugins/*/``), each with a key
    that changes when its editable install must be redone: its ``pyproject.toml`` and the
    names under its ``src/`` (the packages an editable install exposes)."""
    folders = [tree / "core", *sorted((tree / "plugins").glob("*"))]
    found = {}
    for folder in folders:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            digest = hashlib.sha256(pyproject.read_bytes())
            for name in sorted(p.name for p in (folder / "src").glob("*")):
                digest.update(name.encode())
            found[folder] = digest.hexdigest()
    return found


def is_project_distribution(dist: importlib.metadata.Distribution) -> bool:
    """Whether ``dist`` is one of this project's: the core, a plugin, or any plugtrain plugin."""
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    return (
        name == "plugtrain"
        or name.startswith("plugtrain-")
        or any(ep.group == PLUGIN_GROUP for ep in dist.entry_points)
    )


def hidden_names(site_dir: Path) -> set[str]:
    """Top-level names in ``site_dir`` that belong to this project's distributions."""
    hidden = set()
    for dist in importlib.metadata.distributions(path=[str(site_dir)]):
        if not is_project_distribution(dist):
            continue
        # NOTE: _path (the .dist-info folder) is not public API, but a distribution whose
        # RECORD is missing lists no files, and its metadata must be hidden all the same.
        hidden.add(Path(getattr(dist, "_path", "")).name)
        for file in dist.files or []:
            if file.parts and file.parts[0] != "..":
                hidden.add(file.parts[0])
    return hidden


def outer_site_dirs() -> list[Path]:
    """The package folders of the Python running this script, in ``sys.path`` order."""
    dirs = []
    for entry in sys.path:
        path = Path(entry)
        if path.name in ("site-packages", "dist-packages") and path.is_dir() and path not in dirs:
            dirs.append(path)
    return dirs


@dataclass
class Environment:
    """A throwaway virtual environment that sees the outer packages, minus the project's."""

    root: Path
    env: dict[str, str]
    """The environment pip runs in (:func:`commit_environment`)."""
    installed: dict[Path, tuple[str, str]] = field(default_factory=dict)
    """Editable installs done so far: folder -> (install key, distribution name)."""

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def create(self) -> None:
        """Make the environment: a venv plus, per outer package folder, a "view" folder of
        symlinks to everything in it except the project's distributions, on ``sys.path``."""
        venv.EnvBuilder(symlinks=True, with_pip=False).create(self.root)
        site_packages = Path(
            sysconfig.get_path("purelib", vars={"base": self.root, "platbase": self.root})
        )
        views = []
        for index, site_dir in enumerate(outer_site_dirs()):
            view = self.root / "views" / str(index)
            view.mkdir(parents=True)
            hidden = hidden_names(site_dir)
            for entry in site_dir.iterdir():
                if entry.name not in hidden:
                    (view / entry.name).symlink_to(entry)
            views.append(str(view))
        # NOTE: plain path lines: the outer folders' own .pth files are not processed, so an
        # outer editable install of the project (a .pth naming a checkout) stays invisible.
        (site_packages / "zz_stack_check_outer_packages.pth").write_text("\n".join(views) + "\n")
        # Programs that packages ship as binaries (ruff) are found next to the interpreter;
        # Python console scripts are not linked: they would run the outer interpreter.
        for program in Path(sysconfig.get_path("scripts")).iterdir():
            linked = self.root / "bin" / program.name
            if program.is_file() and not linked.exists() and is_binary(program):
                linked.symlink_to(program)

    def sync(self, distributions: dict[Path, str]) -> list[str]:
        """Make the installed distributions those of ``distributions`` (folder -> key):
        (re)install, editable, offline and without dependencies, each new or changed one,
        uninstall each gone or changed one first. Return the names of the folders installed."""
        changed = [f for f, key in distributions.items() if self.installed.get(f, ("",))[0] != key]
        stale = [f for f in self.installed if f not in distributions or f in changed]
        if stale:
            self.pip("uninstall", "-y", *(self.installed.pop(f)[1] for f in stale))
        if changed:
            editable = [arg for folder in changed for arg in ("-e", str(folder))]
            self.pip("install", "--no-deps", "--no-build-isolation", "--no-index", *editable)
            for folder in changed:
                self.installed[folder] = (distributions[folder], distribution_name(folder))
        return [folder.name for folder in changed]

    def pip(self, *args: str) -> None:
        result = subprocess.run(
            [str(self.python), "-m", "pip", "-q", "--disable-pip-version-check", *args],
            capture_output=True,
            text=True,
            env=self.env,
        )
        if result.returncode != 0:
            raise CommitFailed(f"pip {args[0]} failed:\n{result.stdout}{result.stderr}")


def is_binary(path: Path) -> bool:
    """Whether ``path`` is a compiled program rather than a script (it holds a NUL byte)."""
    with path.open("rb") as f:
        return b"\0" in f.read(1024)


def distribution_name(folder: Path) -> str:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]


class CommitFailed(Exception):
    """The commit under test cannot be installed: reported like a test failure."""


def split_pytest_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` as (options with their values, paths): what pytest would collect from."""
    options: list[str] = []
    paths: list[str] = []
    expects_value = only_paths = False
    for arg in args:
        if only_paths:
            paths.append(arg)
        elif expects_value:
            options.append(arg)
            expects_value = False
        elif arg == "--":
            only_paths = True
        elif arg.startswith("-"):
            options.append(arg)
            expects_value = arg in PYTEST_OPTIONS_WITH_VALUE
        else:
            paths.append(arg)
    return options, paths


def path_of(node: str) -> str:
    """The file or folder part of a pytest path or node id, normalised."""
    return node.split("::")[0].removeprefix("./").rstrip("/")


def is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + "/")


@dataclass(frozen=True)
class Selection:
    """What one commit runs: pytest's arguments (``None``: no tests) and why."""

    pytest_args: list[str] | None
    reason: str


def changed_files(repo: Path, sha: str) -> list[str]:
    """The paths ``sha`` changes against its first parent (renames as delete + add)."""
    out = git("diff", "--name-only", "--no-renames", "-z", f"{sha}^", sha, "--", cwd=repo)
    return [name for name in out.split("\0") if name]


def only_plugin(repo: Path, sha: str, files: list[str]) -> str | None:
    """The plugin whose folder is all ``sha`` changes, counting its own requirements line."""
    names = {f.split("/")[1] for f in files if f.startswith("plugins/") and f.count("/") >= 2}
    if len(names) != 1:
        return None
    (name,) = names
    others = [f for f in files if not f.startswith(f"plugins/{name}/")]
    if not others:
        return name
    if others != ["requirements-dev.txt"]:
        return None
    # Adding (or removing) a plugin adds (or removes) its one line, nothing else.
    diff = git("diff", "-U0", "--no-renames", f"{sha}^", sha, "--", others[0], cwd=repo)
    own_line = re.compile(rf"-e \./plugins/{re.escape(name)}(\[[^\]]*\])?")
    edits = [
        line[1:].strip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    return name if all(own_line.fullmatch(edit) for edit in edits) else None


def is_documentation(path: str) -> bool:
    return path.endswith(".md") or path.startswith("docs/")


def is_test_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def tests_naming(repo: Path, sha: str, words: list[str]) -> list[str]:
    """The test files of ``sha`` (under ``tests/`` and ``plugins/``) that name one of
    ``words``, directly or through a helper module under ``tests/`` that names it."""

    def files_naming(patterns: list[str]) -> list[str]:
        args = [arg for word in patterns for arg in ("-e", word)]
        result = subprocess.run(
            ["git", "grep", "-l", "-w", "-F", *args, sha, "--", "tests", "plugins"],
            cwd=repo,
            capture_output=True,
            text=True,
            env=commit_environment(repo),
        )
        if result.returncode not in (0, 1):  # 1: no match
            raise StackCheckError(f"git grep: {result.stderr.strip()}")
        return [line.split(":", 1)[1] for line in result.stdout.splitlines()]

    found = files_naming(words)
    helpers = [
        f.rsplit("/", 1)[-1].removesuffix(".py")
        for f in found
        if f.startswith("tests/") and f.endswith(".py") and not is_test_file(f)
    ]
    if helpers:
        found += files_naming(helpers)
    return sorted({f for f in found if is_test_file(f)})


def select_tests(repo: Path, sha: str, pytest_args: list[str]) -> Selection:
    """What commit ``sha`` runs of ``pytest_args`` (module docstring), and why."""
    files = changed_files(repo, sha)
    options, given = split_pytest_args(pytest_args)
    plugin = only_plugin(repo, sha, files)
    if files and all(is_documentation(f) for f in files):
        documents = sorted({f.rsplit("/", 1)[-1] for f in files})
        selected = tests_naming(repo, sha, documents)
        why = f"documentation only ({', '.join(documents)})"
        if not selected:
            return Selection(None, f"{why}: no test reads it, no tests to run")
        why += ": the tests that name it"
    elif plugin is not None:
        tree = set(git("ls-tree", "-r", "--name-only", "-z", sha, cwd=repo).split("\0"))
        own = f"plugins/{plugin}/tests"
        contract = [t for t in CORE_CONTRACT_TESTS if t in tree]
        selected = [own] if any(is_within(f, own) for f in tree) else []
        selected += contract + tests_naming(repo, sha, [plugin, f"plugtrain_{plugin}"])
        why = (
            f"only plugins/{plugin}/ changed: its tests, the core's contract tests "
            "and the tests that name it"
        )
    else:
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return Selection(pytest_args, f"whole selection: it changes {shown or 'nothing'}")
    if given:
        # Stay inside what was asked for: a selected path within a given one, or a given path
        # within a selected one (the more specific of the two).
        inside = [
            s for s in selected for g in given if is_within(s, path_of(g)) and s != g.split("::")[0]
        ]
        inside += [g for g in given if any(is_within(path_of(g), s) for s in selected)]
        selected = inside
        if not selected:
            return Selection(None, f"{why}: none of it in the given paths, no tests to run")
    # Once each; a file inside a selected folder would be collected twice.
    selected = list(dict.fromkeys(selected))
    selected = [s for s in selected if not any(o != s and is_within(s, o) for o in selected)]
    return Selection([*options, *selected], why)


def missing_paths(repo: Path, sha: str, pytest_args: list[str]) -> list[str]:
    """The paths among ``pytest_args`` that commit ``sha`` lacks (none with ``--pyargs``)."""
    options, paths = split_pytest_args(pytest_args)
    if "--pyargs" in options:
        return []
    missing = []
    for path in paths:
        name = path_of(path)
        if name in ("", ".") or Path(name).is_absolute():
            continue
        try:
            git("cat-file", "-e", f"{sha}:{name}", cwd=repo)
        except StackCheckError:
            missing.append(path)
    return missing


class ResultCache:
    """Passing runs, one JSON file each, named by :func:`cache_key`; ``folder=None``: off."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def get(self, key: str) -> dict | None:
        if self.folder is None:
            return None
        try:
            return json.loads((self.folder / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, record: dict) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f"{key}.json.tmp"
        partial.write_text(json.dumps(record, indent=1) + "\n")
        partial.replace(self.folder / f"{key}.json")  # whole or absent, never half written


def cache_key(tree: str, pytest_args: list[str]) -> str:
    """Same tree, same arguments, same Python: the same result."""
    what = [CACHE_VERSION, tree, pytest_args, sys.executable, sys.version]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def cache_folder(repo: Path) -> Path:
    common = git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=repo)
    return Path(common) / CACHE_FOLDER


@contextlib.contextmanager
def temporary_worktree(repo: Path, where: Path, commit: str) -> Iterator[Path]:
    """A detached ``git worktree`` of ``commit`` at ``where``, removed afterwards."""
    git("worktree", "add", "--detach", "--quiet", str(where), commit, cwd=repo)
    try:
        yield where
    finally:
        git("worktree", "remove", "--force", str(where), cwd=repo)


def check_stack(
    repo: Path, base: str, top: str, pytest_args: list[str], *, use_cache: bool = True
) -> int:
    """Check ``base..top`` as the module docstring says; print a report; return 0 if every
    commit passes, 1 otherwise."""
    started_all = time.perf_counter()
    commits = stack_commits(repo, base, top)
    if not commits:
        print(f"stack check: no commits in {base}..{top}: nothing to check")
        return 0
    print(f"stack check: {len(commits)} commits in {base}..{top}")
    bad_messages = [(c, p) for c in commits for p in problems(c.message)]
    for commit, problem in bad_messages:
        print(f"stack check: commit message of {commit}: {problem}")
    if bad_messages:
        print("stack check: FAILED: fix the messages (git rebase -i; see CONTRIBUTING.md)")
        return 1

    cache = ResultCache(cache_folder(repo) if use_cache else None)
    counts = {"ran": 0, "remembered": 0, "no tests": 0}
    with tempfile.TemporaryDirectory(prefix="stack-check-") as tmp, contextlib.ExitStack() as stack:
        run_env = commit_environment(repo)
        env: Environment | None = None
        tree: Path | None = None
        for index, commit in enumerate(commits, 1):
            label = f"[{index}/{len(commits)}] {commit}"
            selection = select_tests(repo, commit.sha, pytest_args)
            if selection.pytest_args is None:
                print(f"stack check: {label}: {selection.reason}", flush=True)
                counts["no tests"] += 1
                continue
            command = ["python", "-m", "pytest", *selection.pytest_args]
            missing = missing_paths(repo, commit.sha, selection.pytest_args)
            if missing:
                # pytest would say only "file or directory not found" among its output, and
                # the check would call it a test failure.
                return failed(
                    label,
                    commit,
                    f"no such path in this commit: {', '.join(missing)} (a pytest path given "
                    "to the check or to --install-hook; choose one this commit has)",
                )
            key = cache_key(git("rev-parse", f"{commit.sha}^{{tree}}", cwd=repo), command[3:])
            remembered = cache.get(key)
            if remembered is not None:
                print(
                    f"stack check: {label}: passed before, not re-run (same tree and pytest "
                    f"arguments as {remembered.get('commit', '?')[:10]}, "
                    f"{remembered.get('seconds', 0):.1f} s then)",
                    flush=True,
                )
                counts["remembered"] += 1
                continue
            print(f"stack check: {label}: {selection.reason}", flush=True)
            print(f"stack check: {label}: {shlex.join(command)}", flush=True)
            if env is None:  # only when a commit must run: a remembered stack costs nothing
                started = time.perf_counter()
                env = Environment(Path(tmp) / "venv", run_env)
                env.create()
                print(f"stack check: environment ready in {time.perf_counter() - started:.1f} s")
                tree = stack.enter_context(temporary_worktree(repo, Path(tmp) / "tree", commit.sha))
            assert tree is not None
            git("checkout", "--detach", "--quiet", commit.sha, cwd=tree)
            git("clean", "-fdxq", cwd=tree)
            started = time.perf_counter()
            try:
                installed = env.sync(distributions_at(tree))
            except CommitFailed as error:
                print(error)
                return failed(label, commit, "its distributions do not install")
            install_s = time.perf_counter() - started
            started = time.perf_counter()
            result = subprocess.run([str(env.python), *command[1:]], cwd=tree, env=run_env)
            test_s = time.perf_counter() - started
            timing = f"installed {len(installed)} in {install_s:.1f} s, tests {test_s:.1f} s"
            if result.returncode != 0:
                return failed(label, commit, f"tests failed ({timing})", command)
            counts["ran"] += 1
            cache.put(
                key,
                {
                    "commit": commit.sha,
                    "subject": commit.subject,
                    "pytest_args": command[3:],
                    "seconds": round(test_s, 1),
                    "checked_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                },
            )
            print(f"stack check: {label}: passed ({timing})", flush=True)
    summary = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    elapsed = time.perf_counter() - started_all
    print(f"stack check: all {len(commits)} commits pass ({summary}; {elapsed:.1f} s)")
    return 0


def failed(label: str, commit: Commit, why: str, command: list[str] | None = None) -> int:
    print(f"stack check: FAILED at {label}: {why}")
    if command:
        print(f"stack check: reproduce: git checkout {commit.sha[:10]} && {shlex.join(command)}")
    return 1


def hooks_dir(repo: Path) -> Path:
    """Where ghstack 0.18 looks for ``pre-ghstack``: ``core.hooksPath`` (relative to the top
    level, as git reads it), else ``<top level>/.git/hooks``."""
    toplevel = Path(git("rev-parse", "--show-toplevel", cwd=repo))
    configured = git("config", "--default", "", "--get", "core.hooksPath", cwd=repo)
    if configured:
        return toplevel / Path(configured).expanduser()
    if not (toplevel / ".git").is_dir():
        raise StackCheckError(
            f"{toplevel} is a linked git worktree: ghstack 0.18 looks for the hook in "
            f"{toplevel}/.git/hooks, which cannot exist here; point core.hooksPath at git's "
            "own hooks folder, then install again: git config core.hooksPath "
            '"$(git rev-parse --path-format=absolute --git-common-dir)/hooks"'
        )
    return toplevel / ".git" / "hooks"


def install_hook(repo: Path, pytest_args: list[str]) -> Path:
    """Write the ``pre-ghstack`` hook that runs this check with ``pytest_args``."""
    hook = hooks_dir(repo) / "pre-ghstack"
    if hook.exists() and HOOK_MARKER not in hook.read_text(errors="replace"):
        raise StackCheckError(f"{hook} exists and is not ours: remove it, then install again")
    hook.parent.mkdir(parents=True, exist_ok=True)
    python = shlex.quote(sys.executable)
    hook.write_text(
        "#!/bin/sh\n"
        f"# pre-ghstack: {HOOK_MARKER}.\n"
        "# ghstack 0.18 runs it as `pre-ghstack <base> <top>` before submitting; a failure\n"
        "# stops the submit. Reinstall after moving your Python environment.\n"
        f'exec {python} "$(git rev-parse --show-toplevel)/scripts/stack_check.py" "$1" "$2" '
        f"-- {shlex.join(pytest_args)}\n"
    )
    hook.chmod(0o755)
    return hook


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv, None) if "--" not in argv else (
        argv[: argv.index("--")], argv[argv.index("--") + 1 :])  # fmt: skip
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- replace the pytest arguments "
        f"(default: {shlex.join(DEFAULT_PYTEST_ARGS)}).",
    )
    parser.add_argument("base", nargs="?", default=DEFAULT_BASE, help="default: origin/main")
    parser.add_argument("top", nargs="?", default="HEAD", help="default: HEAD")
    parser.add_argument(
        "--install-hook", action="store_true", help="install as the pre-ghstack git hook"
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="run every commit's tests, even those that passed before with the same tree",
    )
    args = parser.parse_args(ours)
    pytest_args = DEFAULT_PYTEST_ARGS if pytest_args is None else pytest_args
    repo = Path.cwd()
    try:
        toplevel = Path(git("rev-parse", "--show-toplevel", cwd=repo))
        if args.install_hook:
            hook = install_hook(toplevel, pytest_args)
            print(f"stack check: installed {hook}: `ghstack submit` now runs the stack check")
            return 0
        return check_stack(toplevel, args.base, args.top, pytest_args, use_cache=not args.no_cache)
    except StackCheckError as error:
        print(f"stack check: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
