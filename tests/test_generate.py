"""Tests of ``plugtrain generate`` (plugtrain.commands.generate): loading a checkpoint for
inference, greedy and sampled completions against a cache-free reference, and bad input."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plugtrain.checkpoint.dcp_io import read_checkpoint
from plugtrain.cli import main
from plugtrain.commands.generate import from_checkpoint, load
from plugtrain.errors import CheckpointError
from plugtrain.model.decoding import generate
from plugtrain.testing import tiny_run

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with the ema plugin, checkpointed at steps 3 and 6."""
    folder = tmp_path_factory.mktemp("generate") / "run"
    tiny_run(
        folder, "--checkpoint.enable", "true", "--checkpoint.interval", "3",
        "--plugins.enabled", "ema", "--optimizer.lr", "0.01", steps=6,
    )  # fmt: skip
    return folder


def generate_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_dump_folder_loads_its_latest_checkpoint_and_ema_its_average(run: Path) -> None:
    step6 = run / "checkpoints" / "step-6"
    _, _, latest, _ = from_checkpoint(run)
    saved = read_checkpoint(step6, "model.")
    assert latest.keys() == {k.removeprefix("model.") for k in saved}
    assert all(torch.equal(latest[k.removeprefix("model.")], t) for k, t in saved.items())
    _, _, step3, _ = from_checkpoint(run / "checkpoints" / "step-3")
    _, _, ema, _ = from_checkpoint(step6, weights="ema")
    name = "layers.0.attention.wq.weight"
    assert not torch.equal(step3[name], latest[name])
    assert torch.equal(
        ema[name], read_checkpoint(step6, "plugins.ema.")[f"plugins.ema.average.{name}"]
    )
    assert not torch.equal(ema[name], latest[name])


def reference_greedy(path: Path, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding written out: argmax of the full forward (no cache) until end of text."""
    model, tokenizer = load(path)
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids + new]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            new.append(token)
    return tokenizer.decode(ids + new)[len(tokenizer.decode(ids)) :]


def test_greedy_generation_equals_the_cache_free_loop_and_is_deterministic(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = generate_cli(capsys, str(run), "--prompt", PROMPT, "--max-new-tokens", "30")
    assert (code, err) == (0, "")
    assert out == reference_greedy(run, PROMPT, 30) + "\n"
    assert len(out) > 30  # 30 tokens of text, not an early end
    assert generate_cli(capsys, str(run), "--prompt", PROMPT, "--max-new-tokens", "30")[1] == out
    # --echo: the prompt, then the same text.
    echoed = generate_cli(capsys, str(run), "--prompt", PROMPT, "--max-new-tokens", "30", "--echo")
    assert echoed == (0, PROMPT + out, "")


def test_a_run_on_the_shipped_sample_finds_its_tokenizer(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sample:tokenizer.json``, the default model.tokenizer_path, names the sample's file."""
    step = tmp_path / "step-6"
    shutil.copytree(run / "checkpoints" / "step-6", step)
    config = json.loads((step / "config.json").read_text())
    config["model"]["tokenizer_path"] = "sample:tokenizer.json"
    (step / "config.json").write_text(json.dumps(config))
    args = ("--prompt", PROMPT, "--max-new-tokens", "8")
    assert generate_cli(capsys, str(step), *args) == generate_cli(capsys, str(run), *args)


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def sample(*options: str) -> str:
        code, out, _ = generate_cli(
            capsys, str(run), "--prompt", PROMPT, "--max-new-tokens", "20", "--temperature",
            "0.8", "--device", "cpu", *options,
        )  # fmt: skip
        assert code == 0
        return out

    assert sample("--seed", "1") == sample("--seed", "1")
    assert sample("--seed", "1") != sample("--seed", "2")
    greedy = generate_cli(capsys, str(run), "--prompt", PROMPT, "--max-new-tokens", "20")[1]
    assert sample("--seed", "3", "--top-k", "1") == greedy
    assert sample("--seed", "3", "--top-p", "0.9") != greedy


def damage(run: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the run's step-6 checkpoint, damaged as ``how`` says."""
    step = tmp_path / "step-6"
    shutil.copytree(run / "checkpoints" / "step-6", step)
    if how == "metadata":
        (step / ".metadata").write_bytes(b"not a pickle")
    elif how == "shard":
        shard = next(step.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "config":
        (step / "config.json").unlink()
    elif how == "tokenizer":
        config = json.loads((step / "config.json").read_text())
        config["model"]["tokenizer_path"] = str(tmp_path / "gone.json")
        (step / "config.json").write_text(json.dumps(config))
    elif how == "no-ema":  # the model's tensors alone, as a run without the ema plugin saves
        tensors = read_checkpoint(step, "model.")
        shutil.rmtree(step)
        with warnings.catch_warnings():  # that it saves in one process, as asked
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(step), no_dist=True)
        shutil.copy(run / "checkpoints" / "step-6" / "config.json", step)
    elif how == "shape":
        config = json.loads((step / "config.json").read_text())
        config["model"]["flavor"] = "debug"
        (step / "config.json").write_text(json.dumps(config))
    return step


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", r"no checkpoint at '.*nowhere': give a run's dump folder \(job.dump_folder"),
        ("empty", r"no checkpoint at '.*': give a run's dump folder \(job.dump_folder, trained"),
        ("metadata", r"step-6 is damaged: cannot read its \.metadata"),
        ("shard", r"step-6' is damaged: .*; use another step-N folder"),
        ("config", r"step-6' is damaged: its config\.json cannot be read"),
        ("tokenizer", r"gone\.json' of checkpoint .* is not found: pass --tokenizer with"),
        ("shape", r"does not fit the model it names: parameter '.*' has shape \[\d+, 32\] there"),
        ("no-ema", r"holds no 'ema' weights .*: train with the ema plugin enabled"),
        ("top-p", r"--top-p must be in \(0, 1\], got 0\.0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, message: str
) -> None:
    path = {"missing": tmp_path / "nowhere", "empty": tmp_path}.get(how) or damage(
        run, tmp_path, how
    )
    extra = {"no-ema": ["--weights", "ema"], "top-p": ["--top-p", "0"]}.get(how, [])
    code, out, err = generate_cli(capsys, str(path), "--prompt", PROMPT, *extra)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("plugtrain: error: ")
    assert re.search(message, err), err


def test_load_raises_the_user_error_itself(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load(tmp_path)


def test_an_exported_folder_writes_what_its_checkpoint_and_transformers_write(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plugtrain generate`` on the export of a checkpoint writes what it writes on the
    checkpoint, and ``transformers``' greedy ``generate`` on that folder the same 40 tokens."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    assert main(["export-hf", str(run), "-o", str(folder), "--dtype", "float32"]) == 0
    capsys.readouterr()
    options = ("--prompt", PROMPT, "--max-new-tokens", "40", "--device", "cpu")
    on_checkpoint = generate_cli(capsys, str(run), *options)
    assert on_checkpoint[0] == 0
    assert generate_cli(capsys, str(folder), *options) == on_checkpoint

    model, tokenizer = load(folder)
    prompt = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(PROMPT)]])
    ours = generate(model, prompt, 40)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = hf.generate(
        prompt, do_sample=False, max_new_tokens=40, min_new_tokens=40, eos_token_id=None
    )[:, prompt.shape[1] :]
    assert ours.shape == (1, 40)
    assert ours.tolist() == theirs.tolist()

    capsys.readouterr()  # transformers' loading bar
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    code, out, err = generate_cli(capsys, str(folder), *options)
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert "'attention_bias'" in err, err
