"""The repository's promises: README's commands are CI's, the code is lint-clean, plugin folders
are distributions, and no tracked file names a package index."""

from __future__ import annotations

import functools
import hashlib
import re
import subprocess
import sys
import textwrap
import warnings


def test_ci_runs_exactly_the_readme_setup_and_test_commands(repo, readme_command):
    ci = [
        line
        for line in (repo / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [readme_command(repo, "setup"), readme_command(repo, "test")]


def test_readme_run_command_is_plain_train_py(repo, readme_command):
    assert readme_command(repo, "run") == "python train.py"


def test_ruff_lint_and_format_are_clean(repo):
    for cmd in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *cmd], cwd=repo, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def plugin_folders(repo) -> tuple[list, list[str]]:
    """The plugin folders to check, and the names of stale ones.

    A folder is stale when git sees nothing in it but ignored files: what another branch left
    behind after ``git checkout`` (its ``*.egg-info``, ``__pycache__``). A folder with tracked
    or new (untracked, unignored) files is a plugin, or the start of one, and is checked.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "plugins"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    alive = {name.split("/")[1] for name in listed if name.count("/") >= 2}
    folders = sorted(p for p in (repo / "plugins").iterdir() if p.is_dir())
    return [f for f in folders if f.name in alive], [f.name for f in folders if f.name not in alive]


def plugin_folder_problems(repo) -> list[str]:
    """What is wrong with each plugin folder, in words; stale folders are skipped."""
    import tomllib

    found = []
    requirements = (repo / "requirements-dev.txt").read_text()
    for folder in plugin_folders(repo)[0]:
        where = f"plugins/{folder.name}"
        if not (folder / "pyproject.toml").is_file():
            found.append(f"{where} has no pyproject.toml")
            continue
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        entry_points = list(project.get("entry-points", {}).get("plugtrain.plugins", {}))
        if entry_points != [folder.name]:
            found.append(f"{where}: plugtrain.plugins entry points {entry_points}, not one")
        if project["name"] != "plugtrain-" + folder.name.replace("_", "-"):
            found.append(f"{where}: distribution {project['name']!r}")
        if not (folder / "src" / f"plugtrain_{folder.name}" / "__init__.py").is_file():
            found.append(f"{where} has no src/plugtrain_{folder.name}/__init__.py")
        if not (folder / "tests").is_dir():
            found.append(f"{where} has no tests/")
        if f"-e ./plugins/{folder.name}" not in requirements:
            found.append(f"{where} is not in requirements-dev.txt (-e ./{where})")
    return found


def test_every_plugin_folder_is_a_distribution_with_tests(repo):
    stale = plugin_folders(repo)[1]
    if stale:
        # Not a failure of the code under test, but worth a line in the summary.
        warnings.warn(
            f"skipped stale plugin folders {stale}: only ignored files (another branch's "
            f"build output); remove them with: git clean -fdX "
            + " ".join(f"plugins/{name}" for name in stale),
            stacklevel=1,
        )
    assert plugin_folder_problems(repo) == []


def test_a_stale_plugin_folder_is_skipped_and_named(tmp_path):
    """``git checkout`` from a branch that added a plugin leaves its ignored ``*.egg-info``
    behind, so the folder survives without a pyproject.toml: it must not hide real problems
    (under ``-x``, a FileNotFoundError used to stop the run there)."""
    for name, text in {
        ".gitignore": "*.egg-info/\n",
        "requirements-dev.txt": "-e ./plugins/good\n",
        "plugins/good/pyproject.toml": textwrap.dedent("""
            [project]
            name = "plugtrain-good"
            [project.entry-points."plugtrain.plugins"]
            good = "plugtrain_good"
        """),
        "plugins/good/src/plugtrain_good/__init__.py": "",
        "plugins/good/tests/test_good.py": "",
        "plugins/gone/src/plugtrain_gone.egg-info/PKG-INFO": "Name: plugtrain-gone\n",
        "plugins/new/README.md": "# new\n",  # untracked, not ignored: a plugin being written
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", ".gitignore", "requirements-dev.txt", "plugins/good"],
                   cwd=tmp_path, check=True)  # fmt: skip
    assert plugin_folders(tmp_path)[1] == ["gone"]
    assert plugin_folder_problems(tmp_path) == [
        "plugins/new has no pyproject.toml",
    ]


# Where packages come from is the installer's configuration (pip.conf, the environment, a CI
# repository variable), never the repository's. Two checks, neither spelling what it looks for:
# the ways of naming an index (pip's index and find-links options, long or short, a "/simple"
# index path, an installer variable or a pip.conf key set to a URL), and the hosts of the
# public indexes themselves, known only by the sha256 of their names: PyPI's pages, its file
# host and its legacy name, PyTorch's wheel host, Anaconda's channels and NVIDIA's index.
INDEX_OPTIONS = re.compile(
    r"--(?:extra-index-url|index-url|find-links)\b"
    r"|(?<!\S)-[if]\s*[\"']?\w+://"
    r"|\w+://\S+/simple(?![\w-])"
    r"|\b(?:PIP|UV)_(?:EXTRA_)?INDEX_URL\s*[:=]\s*[\"']?\w+://"
    r"|^\s*(?:extra-)?index(?:-url)?\s*=\s*[\"']?\w+://",
    re.IGNORECASE,
)
INDEX_HOSTS = frozenset(
    {
        "a4aa2ac280bb8d1a0ce7a1be5a7bfb10292b49fe9435ad5cff19f421f3c70e41",
        "8b5bb5eb9d758455b8635855cf8aaf05b68775e3f83f0291e800ef338fb9783c",
        "d6d7019ca9fcbf07c769e445342515ef0c92e4f18a96adbb3bf6460f5b0ba17f",
        "03e390c8d8a6f2cf7bd2459306b376972ea6d6d28453d4a52dcd6c6c06fc9091",
        "51c6b9f69c48a75b146d2785c3d70d336d5fdce24868f2e22db377d736f2ef24",
        "bd848f96e7140691505c2e7fa56266ed0515b223ad2188d7aa428dfc77c2823f",
    }
)
"""sha256 hex digests of index host names; a name matches when it or a parent domain does."""
HOST_NAME = re.compile(r"(?<![\w.-])(?:[a-z0-9-]+\.)+[a-z]{2,}(?![\w-])", re.IGNORECASE)


@functools.cache
def is_index_host(name: str, hosts: frozenset[str]) -> bool:
    labels = name.lower().split(".")
    return any(
        hashlib.sha256(".".join(labels[i:]).encode()).hexdigest() in hosts
        for i in range(len(labels) - 1)
    )


def index_mentions(repo, hosts: frozenset[str] = INDEX_HOSTS) -> list[str]:
    """``path:line: text`` for each line of a tracked text file that names a package index."""
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
            if INDEX_OPTIONS.search(line) or any(
                # Escaped dots too: a regular expression names a host all the same.
                is_index_host(host, hosts)
                for host in HOST_NAME.findall(line.replace("\\.", "."))
            ):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_tracked_file_names_a_package_index(repo):
    assert index_mentions(repo) == []


def test_the_package_index_check_finds_what_it_looks_for(tmp_path):
    # The options are joined at run time, so that this file passes its own check; the host
    # stands for a real index's through its digest.
    dashes, url = "--", "https://example.invalid"
    hosts = frozenset({hashlib.sha256(b"index.example").hexdigest()})
    lines = [
        f"pip install {dashes}extra-index-url {url}/simple torch",
        f"pip install {dashes}index-url={url}/whl/cpu torch",
        f"pip install -i {url}/whl/cpu torch",
        f"{dashes}find-links {url}/wheels",
        f"  PIP_EXTRA_INDEX_URL: '{url}/whl'",
        f"export UV_INDEX_URL={url}/whl",
        f"index-url = {url}/whl",
        f"see {url}/simple/",
        "wheels: download.index.example/whl/cpu",  # a subdomain of a known host, no scheme
        r"re.compile(r'index\.example')",
    ]
    fine = [
        "index = 0",
        "grep -i pattern file.txt",
        'echo "PIP_EXTRA_INDEX_URL=$TORCH_INDEX_URL" >> "$GITHUB_ENV"',
        "the index.examples folder; not-index.example; torch.distributed.checkpoint",
    ]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "ci.yml").write_text("\n".join([*fine, *lines]) + "\n")
    (tmp_path / "binary.bin").write_bytes(b"\0" + lines[0].encode())
    (tmp_path / "untracked.txt").write_text(lines[0])
    subprocess.run(["git", "add", "ci.yml", "binary.bin"], cwd=tmp_path, check=True)
    assert index_mentions(tmp_path, hosts) == [
        f"ci.yml:{number}: {line.strip()}" for number, line in enumerate(lines, len(fine) + 1)
    ]
