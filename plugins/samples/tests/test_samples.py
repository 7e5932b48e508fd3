"""samples: its records at each validation, against ``plugtrain generate`` on the checkpoint of
the same step; the same text on every rank; its config errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugtrain_samples import Samples

from plugtrain.plugin import ConfigError, ValidationContext, hookimpl
from plugtrain.testing import SAMPLE, setup_context, tiny_run

NAME = "samples"
PROMPTS = ["ROMEO:", "The king"]
ARGS = (
    "--plugins.enabled", NAME, "--samples.prompts", json.dumps(PROMPTS),
    "--samples.max_new_tokens", "12",
    "--validation.interval", "2", "--validation.steps", "1",
    "--data.validation_path", str(SAMPLE / "validation.jsonl"),
    "--optimizer.lr", "0.01",
)  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("prompts", "[]", r"'samples\.prompts' must hold at least one prompt"),
        ("max_new_tokens", "0", r"'samples\.max_new_tokens' must be >= 1, got 0"),
        ("temperature", "-1", r"'samples\.temperature' must be >= 0, got -1\.0"),
    ],
)
def test_a_bad_setting_is_a_one_line_config_error(option: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setup_context({}, "--plugins.enabled", NAME, f"--samples.{option}", value)


def test_without_validation_it_deactivates_itself_and_says_why(tmp_path: Path) -> None:
    run = tiny_run(tmp_path / "run", "--plugins.enabled", NAME, steps=1)
    plugins = json.loads((run.dump_folder / "run.json").read_text())["plugins"]
    assert plugins[NAME]["inactive"] == (
        "validation.interval is 0: no validation to write samples at"
    )


def samples_of(records: list[dict]) -> dict[int, list[str]]:
    """The texts each record holds, by step: ``samples/0``, ``samples/1``, ... in order."""
    return {
        r["step"]: [r[f"{NAME}/{i}"] for i in range(len(PROMPTS))]
        for r in records
        if f"{NAME}/0" in r
    }


def test_each_validation_logs_a_text_per_prompt(tmp_path: Path) -> None:
    run = tiny_run(tmp_path / "run", *ARGS, steps=4)
    texts = samples_of(run.metrics)
    assert list(texts) == [2, 4]  # the validation steps, and only them
    validations = [r for r in run.metrics if "validation_loss" in r]
    assert [r["step"] for r in validations] == [2, 4]
    assert all(f"{NAME}/0" in r for r in validations)
    for step_texts in texts.values():
        assert all(isinstance(t, str) and t for t in step_texts)
    assert texts[2] != texts[4]  # the model changed between them, and so did what it writes


GENERATE_ALL = """
import contextlib, io, json, sys
from plugtrain.cli import main
printed = []
for path, prompt in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["generate", path, "--prompt", prompt, "--max-new-tokens", "12",
                     "--device", "cpu"])
    if code:
        sys.exit(code)
    printed.append(out.getvalue())
print(json.dumps(printed))
"""
"""Runs ``plugtrain generate``'s command line for each ``(path, prompt)`` in one process (a
process per call spent most of the test's time importing torch; plugins' tests may not import
plugtrain.cli); prints what each printed, as a JSON list."""


def generate_cli(calls: list[tuple[str, str]]) -> list[str]:
    """What ``plugtrain generate`` prints for each ``(path, prompt)``."""
    out = subprocess.run(
        [sys.executable, "-c", GENERATE_ALL, json.dumps(calls)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [text.removesuffix("\n") for text in json.loads(out.stdout)]


@pytest.mark.slow
def test_the_logged_text_is_what_generate_writes_from_the_checkpoint(tmp_path: Path) -> None:
    run = tiny_run(
        tmp_path / "run", *ARGS, "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        steps=4,
    )  # fmt: skip
    texts = samples_of(run.metrics)
    steps = (2, 4)
    calls = [(str(run.dump_folder / "checkpoints" / f"step-{step}"), p)
             for step in steps for p in PROMPTS]  # fmt: skip
    written = generate_cli(calls)
    for i, step in enumerate(steps):
        assert written[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] == texts[step], step


class RankTexts(Samples):
    """The samples plugin, also writing what it reports at each validation, on this rank, to a
    file."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder, self.texts = folder, {}

    @hookimpl
    def validation_metrics(self, ctx: ValidationContext) -> dict[str, str] | None:
        texts = super().validation_metrics(ctx)
        if texts is not None:
            self.texts[ctx.step] = {f"{NAME}/{i}": text for i, text in texts.items()}
            path = Path(self.folder) / f"texts.rank{self.rank}.json"
            path.write_text(json.dumps(self.texts))
        return texts


@pytest.mark.slow
def test_every_rank_writes_the_same_text(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    run = tiny_run(
        folder, *ARGS, "--samples.temperature", "1.0", plugins=[(NAME, RankTexts(str(folder)))],
        steps=4, world_size=2,
    )  # fmt: skip
    ranks = [json.loads((folder / f"texts.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    logged = {str(step): dict(zip([f"{NAME}/{i}" for i in range(2)], t, strict=True))
              for step, t in samples_of(run.metrics).items()}  # fmt: skip
    assert ranks[0] == logged
