"""README's and the user docs' figures, commands and links: each figure is checked against the
code, the config defaults or a run; each shell command against the code that would run it
(parsed, its config built, nothing run); each relative link leads to a file and heading."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import plugtrain.cli
from plugtrain.config import CheckpointConfig, MetricsConfig, TrainingConfig, ValidationConfig
from plugtrain.errors import ConfigError
from plugtrain.observability.metrics import format_line
from plugtrain.testing import read_metrics
from plugtrain.training.launch import configure
from plugtrain.training.launcher import split_launch_options
from plugtrain.training.trainer import Trainer

NUMBER = r"\d[\d.,e+-]*"
"""A number as the console prints it: 8.1219, 1.50e-04, 5,308."""
REPO = Path(__file__).resolve().parents[1]
USER_PAGES = (
    "README.md",
    *(f"docs/{name}.md" for name in ("configuration", "data", "parallelism", "checkpoints")),
    *(f"docs/{name}.md" for name in ("hf", "evaluation", "observability", "plugins")),
)
"""README and the pages its manual was split into: every shell command on them is checked here
(README's labelled set-up, run and test commands by tests/repository/test_repository.py)."""
LABELLED = {"setup", "run", "test", "user install", "lm eval", "s3 locally"}
"""The ``<!-- label -->`` command blocks that other tests run: README's set-up, run and test
(checked against CI by tests/repository/), its user install (tests/test_install.py), the
lm-eval recipe of docs/evaluation.md (tests/test_lm_eval.py), and docs/checkpoints.md's S3
server on the loopback address (tests/test_object_store_runs.py)."""


@pytest.fixture
def readme(repo) -> str:
    return (repo / "README.md").read_text()


@pytest.fixture
def observability(repo) -> str:
    return (repo / "docs" / "observability.md").read_text()


def sample_line(page: str) -> str:
    """The line in the fenced block after docs/observability.md's ``<!-- sample line -->``."""
    found = re.search(r"<!-- sample line -->\n```\n(.+)\n```", page)
    assert found, "docs/observability.md has no '<!-- sample line -->' block"
    return found.group(1)


def fields(line: str) -> dict[str, str]:
    """A console line's values by label, as printed (``{"loss": "8.1219", ...}``)."""
    return dict(re.findall(rf"([a-z/]+) +({NUMBER})", line))


def test_the_run_described_is_the_default_run(repo, readme):
    train, every = TrainingConfig(), "every {} steps"
    assert f"{train.steps} steps of {train.batch_size} x {train.seq_len} tokens" in readme
    assert f"a line {every.format(MetricsConfig().log_freq)}" in readme
    assert f"held-out plays {every.format(ValidationConfig().interval)}" in readme
    assert f"outputs/run/checkpoints/step-{train.steps}/" in readme
    checkpoints = (repo / "docs" / "checkpoints.md").read_text()
    assert f"`checkpoint.keep_latest_k` (default {CheckpointConfig().keep_latest_k}," in checkpoints


def test_the_torch_version_is_the_pinned_one(repo, readme):
    (pin,) = re.findall(r"^torch==(\S+)$", (repo / "requirements-dev.txt").read_text(), re.M)
    assert f"installs torch {pin} (pinned" in readme


def test_the_sample_lines_figures_agree_with_each_other(observability):
    """Throughput follows from the step time (printed in whole milliseconds)."""
    sample = fields(sample_line(observability))
    train = TrainingConfig()
    seconds = float(sample["time"]) / 1000
    tokens_per_sec = train.batch_size * train.seq_len / seconds
    printed = int(sample["tok/s"].replace(",", ""))
    # The relative errors of a time rounded to the millisecond, and of tokens/s to the token.
    assert printed == pytest.approx(tokens_per_sec, rel=0.5e-3 / seconds + 0.5 / printed)


@pytest.mark.slow
def test_the_sample_line_is_the_default_runs_first_step(tmp_path, repo, observability, monkeypatch):
    """Its loss and learning rate are those of ``python train.py``'s first step, and it has
    the fields, in order, that the console prints. The run leaves a checkpoint that
    ``plugtrain generate DUMP_FOLDER --prompt ...`` reads with no other flag."""
    monkeypatch.chdir(repo)  # the default config's paths are relative to the repository
    configured = configure(
        ["--job.dump_folder", str(tmp_path), "--training.steps", "1", "--validation.interval", "0"]
    )
    assert configured is not None
    Trainer(*configured).run()
    (record,) = read_metrics(tmp_path)
    sample, printed = sample_line(observability), format_line(record)
    assert re.sub(NUMBER, "N", sample) == re.sub(NUMBER, "N", printed)
    assert {k: fields(sample)[k] for k in ("step", "loss", "lr")} == {
        k: fields(printed)[k] for k in ("step", "loss", "lr")
    }
    assert plugtrain.cli.main(["generate", str(tmp_path), "--prompt", "ROMEO:"]) == 0


# -- the pages' shell commands ------------------------------------------------------------------

SHELL_BLOCK = re.compile(
    r"(?:<!-- (?P<label>[\w ]+) -->\n)?^```(?:bash|sh)\n(?P<body>.*?)^```", re.S | re.M
)


def shell_commands(page: str) -> list[str]:
    """The commands of ``page``'s unlabelled shell blocks: one per line, continuations joined,
    comment lines left out (trailing comments stay: shlex drops them)."""
    commands = []
    for block in SHELL_BLOCK.finditer((REPO / page).read_text()):
        if block["label"] in LABELLED:
            continue
        for line in block["body"].replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def training_arguments(argv: list[str]) -> list[str] | None:
    """The config arguments of a training command (``python train.py``, ``torchrun ...
    train.py``, ``plugtrain train``), or None for another command."""
    if argv[:2] == ["plugtrain", "train"]:
        return split_launch_options(argv[2:])[1]  # torchrun's options go to the launcher
    if argv[0] in ("python", "torchrun") and "train.py" in argv:
        return split_launch_options(argv[argv.index("train.py") + 1 :])[1]
    return None


DOC_COMMANDS = [(page, command) for page in USER_PAGES for command in shell_commands(page)]


def test_the_pages_have_the_commands_this_file_checks():
    """A block regex that stopped matching would check nothing, and pass."""
    assert len(DOC_COMMANDS) >= 20, DOC_COMMANDS
    two = "torchrun --nproc_per_node=2 train.py --config configs/debug.toml"
    assert ("docs/parallelism.md", two) in DOC_COMMANDS


@pytest.mark.parametrize(("page", "command"), DOC_COMMANDS)
def test_each_command_of_the_pages_is_valid(page, command, repo, monkeypatch):
    """A training command's config builds (plugins loaded, every key and value validated), as
    the run would build it before training; a plugtrain sub-command's arguments parse; a pip
    install names distributions of the repository. Nothing is trained, read or written."""
    argv = shlex.split(re.sub(r"^(\w+=\S+ )+", "", command), comments=True)  # env assignments
    monkeypatch.chdir(repo)  # the configs' and commands' paths are relative to the repository
    arguments = training_arguments(argv)
    if arguments is not None:
        assert configure(arguments) is not None, command
    elif argv[0] == "plugtrain":
        ran = []
        monkeypatch.setattr(plugtrain.cli, "run_cli", lambda main: ran.append(main) or 0)
        assert plugtrain.cli.command(argv[1:]) == 0 and ran, command
    elif argv[:4] == ["python", "-m", "pip", "install"]:
        folders = [arg for arg in argv[4:] if arg.startswith("./")]
        assert folders, command
        for folder in folders:
            assert (repo / folder / "pyproject.toml").is_file(), f"{folder} ({command})"
    else:
        pytest.fail(f"{page}: no test checks {command!r}: teach this test how, or label it")


def test_a_bad_command_on_a_page_would_be_caught(monkeypatch, repo):
    """The check above fails on a misspelt key and a misspelt option."""
    monkeypatch.chdir(repo)
    with pytest.raises(ConfigError, match=r"unknown config key 'training\.stepz'"):
        configure(["--training.stepz", "3"])
    monkeypatch.setattr(plugtrain.cli, "run_cli", lambda main: 0)
    with pytest.raises(SystemExit):
        plugtrain.cli.command(["generate", "outputs/run", "--prompts", "x"])


# -- links -----------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def linking_pages() -> list[Path]:
    """Every Markdown page of the repository a reader follows links from."""
    pages = [*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), REPO / "core" / "README.md"]
    return sorted([*pages, *(REPO / "plugins").glob("*/README.md")])


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces
    as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    found = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"\w+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            found.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            found.append(f"{target} (no such heading)")
    return found


@pytest.mark.parametrize("page", linking_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section, `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-section-code) [ok](#here) [gone](gone.md) [bad](other.md#b)\n# Here\n"
    )
    assert broken_links(page) == ["gone.md (no such file)", "other.md#b (no such heading)"]
