"""Test each commit of a local stack on its own, before ``ghstack submit`` (CONTRIBUTING.md).

For the commits in ``BASE..TOP``, oldest first: check every message
(``scripts/check_commit_msg.py``), then check each commit out in a temporary ``git worktree``,
install its ``core/`` and ``plugins/*`` (editable, offline) into a throwaway virtual
environment, and run pytest with the given arguments, untouched and the same for every commit.
Stop at the first failure. A commit whose tree passed with the same arguments and Python is not
run again (``<git common dir>/plugtrain-stack-check/``; ``--no-cache``). The environment reuses
the running Python's packages (torch, pytest) through links that leave out this project's
distributions, so each commit sees exactly its own core and plugins.

Usage, from anywhere in the repository::

    python scripts/stack_check.py                       # origin/main..HEAD, -m "not slow" -x
    python scripts/stack_check.py main HEAD~1 -- plugins -q   # BASE TOP -- pytest arguments
    python scripts/stack_check.py --install-hook        # run it before every `ghstack submit`
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import venv
from pathlib import Path

from check_commit_msg import problems  # beside this file: on the path when run as a script

DEFAULT_PYTEST_ARGS = ["-m", "not slow", "-q", "-x"]
"""The fast selection, as CONTRIBUTING.md asks of every commit; stop at the first failure."""
CACHE_FOLDER = "plugtrain-stack-check"
HOOK_MARKER = "installed by scripts/stack_check.py --install-hook"
GIT_LOCATION_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_PREFIX")
"""Set when git runs the script as a hook; they would point git at the wrong repository."""


class StackCheckError(Exception):
    """Bad input or a broken environment: one line saying what and how to fix it."""


def git(*args: str, cwd: Path) -> str:
    """Run git in ``cwd``; return its stripped stdout, or raise with git's message."""
    env = commit_environment(cwd)
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise StackCheckError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


def commit_environment(toplevel: Path) -> dict[str, str]:
    """This process's environment, minus git's location variables and the ``PYTHONPATH``
    entries inside the checkout (its ``core/src`` would shadow the commit's code)."""
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    if "PYTHONPATH" in env:
        entries = env["PYTHONPATH"].split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(
            e for e in entries if e and not Path(e).resolve().is_relative_to(toplevel.resolve())
        )
    return env


def is_project_distribution(dist: importlib.metadata.Distribution) -> bool:
    """The core, a ``plugtrain-*`` distribution, or anything offering a plugtrain plugin."""
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    plugin = any(ep.group == "plugtrain.plugins" for ep in dist.entry_points)
    return name == "plugtrain" or name.startswith("plugtrain-") or plugin


def hidden_names(site_dir: Path) -> set[str]:
    """The top-level names in ``site_dir`` that belong to this project's distributions."""
    hidden = set()
    for dist in importlib.metadata.distributions(path=[str(site_dir)]):
        if is_project_distribution(dist):
            # The .dist-info folder (private ``_path``): listed even when RECORD is missing.
            hidden.add(Path(getattr(dist, "_path", "")).name)
            hidden |= {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
    return hidden


def outer_site_dirs() -> list[Path]:
    """The package folders of the Python running this script, in ``sys.path`` order."""
    found = [Path(p) for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return [p for i, p in enumerate(found) if p.is_dir() and p not in found[:i]]


class Environment:
    """A throwaway virtual environment that sees the outer packages, minus the project's."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env, self.python = root, env, root / "bin" / "python"
        self.installed: dict[Path, tuple[str, list[str]]] = {}  # folder -> what it was

    def create(self) -> None:
        venv.EnvBuilder(symlinks=True).create(self.root)
        views = []
        for index, site_dir in enumerate(outer_site_dirs()):
            view = self.root / "views" / str(index)
            view.mkdir(parents=True)
            hidden = hidden_names(site_dir)
            for entry in site_dir.iterdir():
                if entry.name not in hidden:
                    (view / entry.name).symlink_to(entry)
            views.append(str(view))
        # Plain path lines: the outer folders' .pth files (an outer editable install of the
        # project) are not processed, so they stay invisible.
        paths = {"base": str(self.root), "platbase": str(self.root)}
        site = Path(sysconfig.get_path("purelib", vars=paths))
        (site / "zz_stack_check_outer.pth").write_text("\n".join(views) + "\n")
        # Compiled programs that packages ship (ruff) are looked up next to the interpreter.
        for program in Path(sysconfig.get_path("scripts")).iterdir():
            linked = self.root / "bin" / program.name
            if program.is_file() and not linked.exists() and b"\0" in program.read_bytes()[:1024]:
                linked.symlink_to(program)

    def sync(self, tree: Path) -> None:
        """Install ``tree``'s distributions (``core/``, ``plugins/*/``) that are new or changed
        since the last call, editable; uninstall those gone or changed first."""
        wanted = {
            f: ((f / "pyproject.toml").read_text(), sorted(p.name for p in (f / "src").glob("*")))
            for f in [tree / "core", *sorted((tree / "plugins").glob("*"))]
            if (f / "pyproject.toml").is_file()
        }  # what an editable install depends on: the pyproject and the packages under src/
        changed = [f for f, key in wanted.items() if self.installed.get(f) != key]
        stale = [f for f in self.installed if f not in wanted or f in changed]
        if stale:
            names = [tomllib.loads(self.installed.pop(f)[0])["project"]["name"] for f in stale]
            self.pip("uninstall", "-y", *names)
        if changed:
            editable = [arg for folder in changed for arg in ("-e", str(folder))]
            self.pip("install", "--no-deps", "--no-build-isolation", "--no-index", *editable)
            self.installed.update((f, wanted[f]) for f in changed)

    def pip(self, *args: str) -> None:
        command = [str(self.python), "-m", "pip", "-q", "--disable-pip-version-check", *args]
        result = subprocess.run(command, capture_output=True, text=True, env=self.env)
        if result.returncode != 0:
            raise CommitFailed(f"pip {args[0]} failed:\n{result.stdout}{result.stderr}")


class CommitFailed(Exception):
    """The commit under test cannot be installed: reported like a test failure."""


def check_stack(
    repo: Path, base: str, top: str, pytest_args: list[str], *, use_cache: bool = True
) -> int:
    """Check ``base..top`` as the module docstring says; return 0 if every commit passes."""
    log = git("log", "--reverse", "-z", "--format=%H%n%B", f"{base}..{top}", "--", cwd=repo)
    commits = [r.lstrip("\n").partition("\n")[::2] for r in log.split("\0") if r.strip()]
    print(f"stack check: {len(commits)} commits in {base}..{top}")
    bad = [(sha, p) for sha, message in commits for p in problems(message)]
    for sha, problem in bad:
        print(f"stack check: commit message of {sha[:10]}: {problem}")
    if bad:
        print("stack check: FAILED: fix the messages (git rebase -i; see CONTRIBUTING.md)")
        return 1
    common = git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=repo)
    cache = Path(common) / CACHE_FOLDER
    command = ["python", "-m", "pytest", *pytest_args]
    env = commit_environment(repo)
    with tempfile.TemporaryDirectory(prefix="stack-check-") as tmp:
        environment, tree = None, Path(tmp) / "tree"
        try:
            for index, (sha, message) in enumerate(commits, 1):
                label = f"[{index}/{len(commits)}] {sha[:10]} {message.splitlines()[0]!r}"
                tree_id = git("rev-parse", f"{sha}^{{tree}}", cwd=repo)
                what = [tree_id, pytest_args, sys.executable, sys.version]
                record = cache / f"{hashlib.sha256(json.dumps(what).encode()).hexdigest()}.json"
                if use_cache and record.is_file():
                    print(f"stack check: {label}: passed before with the same tree, not re-run")
                    continue
                print(f"stack check: {label}: {shlex.join(command)}", flush=True)
                if environment is None:  # only once a commit must run
                    environment = Environment(Path(tmp) / "venv", env)
                    environment.create()
                    git("worktree", "add", "--detach", "--quiet", str(tree), sha, cwd=repo)
                git("checkout", "--detach", "--quiet", sha, cwd=tree)
                git("clean", "-fdxq", cwd=tree)
                try:
                    environment.sync(tree)
                except CommitFailed as error:
                    print(f"{error}\nstack check: FAILED at {label}: it does not install")
                    return 1
                run = [str(environment.python), *command[1:]]
                if subprocess.run(run, cwd=tree, env=env).returncode != 0:
                    reproduce = f"git checkout {sha[:10]} && {shlex.join(command)}"
                    print(f"stack check: FAILED at {label}: tests failed; reproduce: {reproduce}")
                    return 1
                if use_cache:
                    cache.mkdir(exist_ok=True)
                    record.write_text(json.dumps({"commit": sha, "pytest_args": pytest_args}))
                print(f"stack check: {label}: passed", flush=True)
        finally:
            if tree.exists():
                git("worktree", "remove", "--force", str(tree), cwd=repo)
    print(f"stack check: all {len(commits)} commits pass")
    return 0


def install_hook(repo: Path, pytest_args: list[str]) -> Path:
    """Write the ``pre-ghstack`` hook, which ghstack 0.18 runs as ``<hooks>/pre-ghstack BASE
    TOP`` before it pushes anything, ``<hooks>`` being ``core.hooksPath`` (relative to the top
    level) or else ``<top level>/.git/hooks``."""
    toplevel = Path(git("rev-parse", "--show-toplevel", cwd=repo))
    configured = git("config", "--default", "", "--get", "core.hooksPath", cwd=repo)
    if not configured and not (toplevel / ".git").is_dir():
        raise StackCheckError(
            f"{toplevel} is a linked git worktree, where ghstack looks for hooks in a "
            "folder that cannot exist; point core.hooksPath at git's own, then install again: "
            'git config core.hooksPath "$(git rev-parse --path-format=absolute '
            '--git-common-dir)/hooks"'
        )
    hook = toplevel / Path(configured or ".git/hooks").expanduser() / "pre-ghstack"
    if hook.exists() and HOOK_MARKER not in hook.read_text(errors="replace"):
        raise StackCheckError(f"{hook} exists and is not ours: remove it, then install again")
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(
        f"#!/bin/sh\n# pre-ghstack: {HOOK_MARKER}; a failure stops the submit.\n"
        f"exec {shlex.quote(sys.executable)} "
        f'"$(git rev-parse --show-toplevel)/scripts/stack_check.py" "$1" "$2" '
        f"-- {shlex.join(pytest_args)}\n"
    )
    hook.chmod(0o755)
    return hook


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Arguments after -- go to pytest (default: {shlex.join(DEFAULT_PYTEST_ARGS)}).",
    )
    parser.add_argument("base", nargs="?", default="origin/main", help="default: origin/main")
    parser.add_argument("top", nargs="?", default="HEAD", help="default: HEAD")
    parser.add_argument("--install-hook", action="store_true", help="as the pre-ghstack hook")
    parser.add_argument("--no-cache", action="store_true", help="re-run commits that passed")
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1 :] if split < len(argv) else DEFAULT_PYTEST_ARGS
    try:
        toplevel = Path(git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
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
