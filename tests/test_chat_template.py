"""The chat template a run records: saved with each checkpoint, exported by ``export-hf`` (the
default template included), used by ``generate --chat``; errors a template raises name the
conversation's file and line.

The judge is transformers: ``AutoTokenizer.from_pretrained(export).apply_chat_template`` must
give the ids the run trained on, which plugtrain.data.chat renders (tests/test_chat.py checks
those against transformers for tokenizers that have their own template).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import TypeVar

import pytest

from plugtrain.checkpoint.layout import CHAT_TEMPLATE, CHAT_TEMPLATE_RECORD
from plugtrain.checkpoint.saved import locate_checkpoint, open_checkpoint
from plugtrain.cli import main
from plugtrain.commands import generate
from plugtrain.commands.generate import chat_template_of
from plugtrain.data import DEFAULT_CHAT_TEMPLATE, ChatOptions, ChatTemplate, Tokenizer
from plugtrain.data.cache import cache_folder
from plugtrain.data.prepare import prepare
from plugtrain.data.store import file_sha256
from plugtrain.errors import DataError
from plugtrain.testing import (
    SAMPLE,
    S3Server,
    make_trainer,
    stored_documents,
    tiny_args,
    tiny_run,
)

transformers = pytest.importorskip("transformers")

CHAT = SAMPLE / "chat_validation.jsonl"
TOKENIZER = SAMPLE / "tokenizer.json"
CUSTOM = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '### ' + m['role'] | upper + ': ' + m['content'] | trim + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### ASSISTANT: ' }}{% endif %}"
)
"""A template of the test's own (its text differs from the default's in every turn)."""
ALTERNATING = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}"
)
"""A template that refuses a conversation whose roles do not alternate."""


def conversations() -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()]


Folder = TypeVar("Folder", Path, str)


def chat_run(folder: Folder, *args: str) -> Folder:
    """A 2-step run on the sample's chat data, checkpointed at its end (``folder`` may be a
    URL)."""
    make_trainer(
        folder,
        *("--data.train_path", str(CHAT), "--training.seq_len", "64"),
        *("--checkpoint.enable", "true", *args),
        steps=2,
    ).run()
    return folder


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_run(tmp_path_factory.mktemp("default") / "run", "--plugins.enabled", "hf_export")


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "custom.jinja"
    path.write_text(CUSTOM)
    return path


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory: pytest.TempPathFactory, custom: Path) -> Path:
    return chat_run(tmp_path_factory.mktemp("custom") / "run", "--data.chat_template", str(custom))


def export(run: Path | str, out: Path, *args: str) -> Path:
    assert main(["export-hf", str(run), "-o", str(out), *args]) == 0
    return out


def trained_ids(template: str = "") -> list[list[int]]:
    """The ids a :func:`chat_run` (``data.chat_template`` ``template``) trained on: each
    conversation of its data file, as the run's prepared cache holds it."""
    options = ChatOptions("auto", template, 64, "truncate")
    return stored_documents(cache_folder(CHAT, file_sha256(TOKENIZER), "text", options))


def transformers_ids(out: Path) -> list[list[int]]:
    """Each conversation of the data file as transformers renders it with the export's
    template, cut to the run's 64 tokens."""
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    return [
        theirs.apply_chat_template(m, tokenize=True, return_dict=False)[:64]
        for m in conversations()
    ]


@pytest.mark.parametrize("which", ["default", "custom"])
def test_the_export_renders_the_training_ids_in_transformers(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, custom: Path
) -> None:
    run = request.getfixturevalue(f"{which}_run")
    source = DEFAULT_CHAT_TEMPLATE if which == "default" else CUSTOM
    # The checkpoint records the template, by its sha256, with the file itself.
    step = Path(locate_checkpoint(run).location)
    assert (step / CHAT_TEMPLATE).read_text() == source
    record = json.loads((step / CHAT_TEMPLATE_RECORD).read_text())
    assert record["sha256"] == hashlib.sha256(source.encode()).hexdigest()
    out = export(run, tmp_path / "hf")
    assert (out / "chat_template.jinja").read_text() == source
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == source
    if which == "default":  # the hf_export plugin writes the same folder
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            assert (step / "hf" / name).read_bytes() == (out / name).read_bytes()
    trained = trained_ids(str(custom) if which == "custom" else "")
    assert len(trained) == len(conversations()) and transformers_ids(out) == trained


def test_generate_chat_renders_with_the_recorded_template(
    custom_run: Path,
    custom: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts: list[list[int]] = []

    def complete(*args: object, prompt_ids: list[int], **kwargs: object) -> str:
        prompts.append(prompt_ids)
        return " ok"

    monkeypatch.setattr(generate, "complete", complete)
    out = export(custom_run, tmp_path / "hf")
    message = [{"role": "user", "content": "Who wrote Hamlet?"}]
    theirs = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
        message, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    rendered = ChatTemplate(CUSTOM, "test").render(message, add_generation_prompt=True)
    capsys.readouterr()
    assert rendered.startswith("<|begin_of_text|>### USER: Who wrote Hamlet?")
    args = ["generate", "--chat", "--prompt", "Who wrote Hamlet?", "--device", "cpu"]
    for path in (custom_run, out):  # the run's checkpoint, and its export
        assert main([*args[:1], str(path), *args[1:], "--echo"]) == 0
        assert prompts.pop() == theirs
        printed = capsys.readouterr()
        assert printed.out == rendered + " ok\n" and printed.err == ""
    # The template the run trained with, given again: nothing to say.
    assert main([*args[:1], str(custom_run), *args[1:], "--chat-template", str(custom)]) == 0
    assert prompts.pop() == theirs and capsys.readouterr().err == ""
    # Another one: used, and said in one line.
    other = tmp_path / "other.jinja"
    other.write_text(DEFAULT_CHAT_TEMPLATE)
    assert main([*args[:1], str(custom_run), *args[1:], "--chat-template", str(other)]) == 0
    tokenizer = Tokenizer.from_file(TOKENIZER)
    default = ChatTemplate(DEFAULT_CHAT_TEMPLATE, "test").render(
        message, add_generation_prompt=True
    )
    assert prompts.pop() == tokenizer.encode(default)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"generate: rendering with --chat-template {re.escape(str(other))} \(sha256 \w{{12}}\), "
        rf"not the model's template .*step-2/chat_template.jinja \(sha256 \w{{12}}\)",
        err[0],
    ), err


def test_a_run_on_s3_records_its_template_and_its_readers_use_it(
    s3_server: S3Server, tmp_path: Path, custom: Path
) -> None:
    url = s3_server.url("chat")
    local = ("--job.local_folder", str(tmp_path / "local"))
    chat_run(url, *local, "--data.chat_template", str(custom))
    out = export(url, tmp_path / "hf")
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CUSTOM
    assert chat_template_of(url).source == CUSTOM


def test_a_run_without_a_record_exports_as_before_and_a_damaged_one_is_named(
    default_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run saved before the template was recorded: its tokenizer's template (the sample's
    # has none: the export carries none, generate --chat renders with the default).
    old = tmp_path / "old"
    shutil.copytree(default_run / "checkpoints", old / "checkpoints")
    step = Path(locate_checkpoint(old).location)
    (step / CHAT_TEMPLATE_RECORD).unlink()
    (step / CHAT_TEMPLATE).unlink()
    out = export(old, tmp_path / "hf")
    assert not (out / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    assert chat_template_of(old).source == DEFAULT_CHAT_TEMPLATE
    # A record whose file was changed is refused, in one line naming the checkpoint.
    damaged = tmp_path / "damaged"
    shutil.copytree(default_run / "checkpoints", damaged / "checkpoints")
    step = Path(locate_checkpoint(damaged).location)
    (step / CHAT_TEMPLATE).write_text(CUSTOM)
    capsys.readouterr()
    assert main(["export-hf", str(damaged), "-o", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(
        rf"plugtrain: error: checkpoint '{re.escape(str(step))}' is damaged: its chat template "
        r"cannot be read \(.*chat_template.jinja has sha256 \w{12}, but its record says \w{12}.*"
        r"\); use another step-N folder of the run\n",
        err,
    ), err


def test_a_text_run_exports_its_tokenizers_own_template_and_invents_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tiny_run(run, "--checkpoint.enable", "true", steps=1)
    assert not (Path(locate_checkpoint(run).location) / CHAT_TEMPLATE).exists()
    out = export(run, tmp_path / "plain")
    assert not (out / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    # The same tokenizer in a folder with its own template: that one, in both places.
    own = tmp_path / "tokenizer"
    own.mkdir()
    shutil.copy(TOKENIZER, own / "tokenizer.json")
    (own / "chat_template.jinja").write_text(CUSTOM)
    out = export(run, tmp_path / "own", "--tokenizer", str(own / "tokenizer.json"))
    assert (out / "chat_template.jinja").read_text() == CUSTOM
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CUSTOM


def test_a_run_on_a_prepared_folder_records_the_template_it_was_prepared_with(
    tmp_path: Path, custom: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ChatOptions(template=str(custom), max_tokens=64)
    folder = prepare([str(CHAT)], tmp_path / "prepared", TOKENIZER, workers=1, chat=options).folder
    run = chat_run(tmp_path / "run", "--data.train_path", str(folder))
    template = open_checkpoint(run).chat_template
    assert template is not None and template.source == CUSTOM
    step = Path(locate_checkpoint(run).location)
    assert json.loads((step / CHAT_TEMPLATE_RECORD).read_text())["origin"] == str(custom)
    # A folder prepared before manifests held the template: data.chat_template's, when the
    # folder's hash is its; else no record, said in a line.
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["chat"]["template_source"], manifest["chat"]["template_record"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    given = ("--data.train_path", str(folder), "--data.chat_template", str(custom))
    template = open_checkpoint(chat_run(tmp_path / "given", *given)).chat_template
    assert template is not None and template.source == CUSTOM
    assert open_checkpoint(chat_run(tmp_path / "unknown", *given[:2])).chat_template is None
    warning = f"WARNING data.train_path '{folder}' was prepared with a chat template the run"
    assert warning in capsys.readouterr().err


def test_a_template_that_is_not_jinja_is_refused_where_it_is_read(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(
        DataError, match=rf"^chat template \({re.escape(str(broken))}\) is not valid"
    ):
        ChatTemplate.for_tokenizer(TOKENIZER, broken)


@pytest.mark.parametrize("command", ["prepare-data", "train"])
def test_a_template_that_raises_names_the_file_and_line_in_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = tmp_path / "alternating.jinja"
    template.write_text(ALTERNATING)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again?"}]
    data = tmp_path / "chat.jsonl"
    lines = [good, good, None, bad, good]  # line 3 is blank: line numbers are the file's
    data.write_text(
        "".join("\n" if m is None else json.dumps({"messages": m}) + "\n" for m in lines)
    )
    if command == "prepare-data":
        args = ["prepare-data", str(data), "-o", str(tmp_path / "out"), "--tokenizer",
                str(TOKENIZER), "--chat-template", str(template), "--workers", "1"]  # fmt: skip
    else:
        args = ["train", *tiny_args(tmp_path / "run", "--data.train_path", str(data),
                                    "--data.chat_template", str(template))]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        f"plugtrain: error: {data}:4: chat template raised: roles must alternate user/assistant "
        f"(template: {template}): fix the conversation, or give a template that accepts it "
        "(data.chat_template; prepare-data: --chat-template)\n"
    )
