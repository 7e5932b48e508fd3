"""checkpoint.initial_load_path: a run started from a Hugging Face folder or a step-N checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from plugtrain.checkpoint import open_initial_load, read_checkpoint
from plugtrain.checkpoint.storage import LocalStorage
from plugtrain.config import CheckpointConfig
from plugtrain.data import Tokenizer
from plugtrain.errors import CheckpointError
from plugtrain.model import cross_entropy, run_model_args
from plugtrain.plugin import local_tensor
from plugtrain.testing import (
    SAMPLE,
    hf_llama_folder,
    hf_llama_logits,
    make_trainer,
    read_metrics,
    run_distributed,
    save_random_llama,
    save_small_checkpoint,
)
from plugtrain.training import configure, run_cli
from plugtrain.training.trainer import Trainer

TOKENIZER = SAMPLE / "tokenizer.json"
SEQ_LEN = 32  # tiny_args'
WEIGHTS = "model.safetensors"


def _tiny_args(**changes: int):
    args = run_model_args("tiny", Tokenizer.from_file(TOKENIZER).vocab_size, SEQ_LEN)
    return args if not changes else type(args)(**{**vars(args), **changes})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """HF folders of the tiny shape: whole (with the sample's tokenizer.json) and in shards;
    one with a larger vocabulary than the sample tokenizer's."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "whole": save_random_llama(root / "whole", _tiny_args(), tokenizer=TOKENIZER),
        "sharded": save_random_llama(root / "sharded", _tiny_args(), max_shard_size="100KB"),
        "vocab": save_random_llama(root / "vocab", _tiny_args(vocab_size=2056)),
    }


def _hf_model(folder: Path) -> torch.nn.Module:
    import transformers  # here: the two-process test's ranks load this module without it

    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _sample_tokens() -> torch.Tensor:
    text = json.loads((SAMPLE / "validation.jsonl").read_text().splitlines()[0])["text"]
    ids = Tokenizer.from_file(TOKENIZER).encode(text)[: 2 * SEQ_LEN]
    return torch.tensor(ids).reshape(2, SEQ_LEN)


def _logits(trainer: Trainer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return trainer.model(tokens).float()


def test_hf_folder_gives_transformers_logits_and_its_loss_at_the_first_step(
    tmp_path, folders, capfd
):
    """Unset model.tokenizer_path takes the folder's tokenizer.json; the first step's loss is
    the HF model's on the same batch."""
    dump = tmp_path / "run"
    trainer = make_trainer(
        dump,
        *("--checkpoint.initial_load_path", str(folders["whole"]), "--model.tokenizer_path", ""),
    )
    assert trainer.config.model.tokenizer_path == str(folders["whole"] / "tokenizer.json")
    log = capfd.readouterr().err
    assert f"initial load from {folders['whole']} (Hugging Face folder, fresh start)" in log
    hf = _hf_model(folders["whole"])
    tokens = _sample_tokens()
    assert (_logits(trainer, tokens) - hf(tokens).logits).abs().max() < 1e-5
    first = trainer.batches.next_batch()
    ((inputs, targets, *_),) = first
    with torch.no_grad():
        expected = cross_entropy(hf(inputs).logits, targets)
    loss, _ = trainer.train_step(first)
    assert abs(loss.item() - expected.item()) < 1e-5
    assert loss.item() - math.log(2048) > 0.1  # not a freshly initialised model's loss
    trainer.close()
    run = json.loads((dump / "run.json").read_text())
    assert run["initial_load"]["kind"] == "hf"
    assert run["initial_load"]["path"] == str(folders["whole"].resolve())
    assert run["initial_load"]["model"] == "whole"
    assert len(run["initial_load"]["config_sha256"]) == 64


def test_fp16_with_the_scaler_starts_at_the_hf_loss(tmp_path, folders):
    """Continued training from the sharded folder, 20 steps in fp16 with grad_scaler and
    grad_clip: the first loss is the fp32 HF loss within fp16's rounding (2.8e-4 measured; fp32
    meets 1e-5, above), and the losses stay finite."""
    dump = tmp_path / "run"
    trainer = make_trainer(
        dump,
        *("--checkpoint.initial_load_path", str(folders["sharded"])),
        *("--plugins.enabled", "grad_clip,grad_scaler", "--grad_clip.max_norm", "1.0"),
        "--training.mixed_precision_param",
        "float16",
        steps=20,
    )
    first = trainer.batches.next_batch()
    ((inputs, targets, *_),) = first
    with torch.no_grad():
        expected = cross_entropy(_hf_model(folders["sharded"])(inputs).logits, targets)
    loss, _ = trainer.train_step(first)
    assert abs(loss.item() - expected.item()) < 2e-3
    trainer.run()
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 19 and all(math.isfinite(x) for x in losses)


def _two_rank_logits(dump: str, folder: str, tokens: torch.Tensor) -> torch.Tensor:
    trainer = make_trainer(dump, "--checkpoint.initial_load_path", folder)
    shards = {n: local_tensor(p.detach()).shape[0] for n, p in trainer.model.named_parameters()}
    logits = _logits(trainer, tokens)
    trainer.close()
    return logits, shards


@pytest.mark.parametrize("variant", ["tied", "scaled"])
def test_flavor_hf_takes_the_folders_shape_tied_or_rope_scaled(tmp_path, variant):
    """flavor hf with no hf_config takes the initial load's config.json: a tied model (no
    lm_head in the folder) and a llama3 RoPE-scaled one give transformers' logits over 128
    positions, twice the scaled variant's original context."""
    folder = hf_llama_folder(tmp_path / variant, variant)
    trainer = make_trainer(
        tmp_path / "run",
        *("--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder)),
        *("--model.tokenizer_path", "", "--training.seq_len", "128"),
    )
    assert trainer.config.model.hf_config == str(folder)
    assert trainer.model_args.tie_embeddings == (variant == "tied")
    assert (trainer.model_args.rope_scaling is not None) == (variant == "scaled")
    text = json.loads((SAMPLE / "validation.jsonl").read_text().splitlines()[0])["text"]
    tokens = torch.tensor(Tokenizer.from_file(TOKENIZER).encode(text)[:128]).unsqueeze(0)
    assert (_logits(trainer, tokens) - hf_llama_logits(folder, tokens)).abs().max() < 1e-5
    trainer.close()


@pytest.mark.slow
def test_two_processes_read_their_shards_and_give_transformers_logits(tmp_path, folders):
    tokens = _sample_tokens()
    ranks = run_distributed(
        _two_rank_logits, 2, str(tmp_path / "run"), str(folders["sharded"]), tokens
    )
    expected = _hf_model(folders["sharded"])(tokens).logits
    for logits, shards in ranks:
        assert (logits - expected).abs().max() < 1e-5
        assert shards["tok_embeddings.weight"] == 1024  # half of the rows: sharded


# ---------------------------------------------------------------- plugtrain step-N folders


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A run with checkpoints at steps 2 and 4 (the optimizer has stepped)."""
    dump = tmp_path_factory.mktemp("source")
    trainer = make_trainer(
        dump, "--checkpoint.enable", "true", "--checkpoint.interval", "2", steps=4
    )
    trainer.run()
    return dump


def test_a_dump_folder_with_checkpoints_resumes_and_ignores_the_initial_load(
    source, folders, capfd, tmp_path
):
    dump = tmp_path / "run"
    shutil.copytree(source, dump)
    trainer = make_trainer(
        dump,
        *("--checkpoint.enable", "true", "--checkpoint.interval", "2"),
        *("--checkpoint.initial_load_path", str(folders["whole"])),
        steps=6,
    )
    log = capfd.readouterr().err
    assert (
        "resuming from step-4 (checkpoint.initial_load_path ignored: the dump folder has "
        "checkpoints, step-2, step-4)" in log
    )
    assert "initial load" not in log
    assert trainer.initial_load is None and trainer.step == 4
    saved = read_checkpoint(dump / "checkpoints" / "step-4", "model.")
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), saved[f"model.{name}"])
    trainer.close()
    run = json.loads((dump / "run.json").read_text())
    assert run["initial_load"] is None and run["resumed_from"]["step"] == 4


def test_a_step_folder_loads_its_weights_and_moments_bitwise_under_a_new_schedule(source, tmp_path):
    step = source / "checkpoints" / "step-4"
    saved = read_checkpoint(step)
    new_schedule = ("--optimizer.lr", "1e-3", "--lr_scheduler.decay_type", "linear")
    for model_only in ("true", "false"):
        trainer = make_trainer(
            tmp_path / model_only,
            *("--checkpoint.initial_load_path", str(step)),
            *("--checkpoint.initial_load_model_only", model_only, *new_schedule),
            steps=2,
        )
        assert trainer.step == 0 and int(trainer.lr_scheduler.applied_steps) == 0
        assert trainer.lr_scheduler.last_lr().item() == pytest.approx(1e-3 / 1)  # warmup 1
        for name, param in trainer.model.named_parameters():
            assert torch.equal(param.detach(), saved[f"model.{name}"]), name
        state = trainer.optimizer.state
        if model_only == "true":
            assert not state
        else:
            names = {param: name for name, param in trainer.model.named_parameters()}
            assert len(state) == len(trainer.params)
            for param, moments in state.items():
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    stored = saved[f"optimizer.state.{names[param]}.{key}"]
                    assert torch.equal(moments[key], stored), (names[param], key)
        trainer.run()  # and it trains on from there
        assert len(read_metrics(tmp_path / model_only)) == 2
        record = json.loads((tmp_path / model_only / "run.json").read_text())["initial_load"]
        assert record["kind"] == "plugtrain" and record["step"] == 4
        assert record["model_only"] is (model_only == "true")


# ---------------------------------------------------------------- bad input


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _damaged(folders: Path, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Bad initial loads: (extra arguments, the start of the one-line error's cause)."""
    bad = {}
    for name, damage in {
        "no_config": lambda f: (f / "config.json").unlink(),
        "no_weights": lambda f: (f / "model.safetensors").unlink(),
        "truncated": lambda f: (f / "model.safetensors").write_bytes(
            (f / "model.safetensors").read_bytes()[:-100]
        ),
        "missing": lambda f: save_file(
            {k: v for k, v in load_file(f / WEIGHTS).items() if k != "model.norm.weight"},
            f / WEIGHTS,
        ),
        "rope_theta": lambda f: _edit_config(f, rope_theta=500000.0),
        "bias": lambda f: _edit_config(f, attention_bias=True),
    }.items():
        folder = tmp_path / name
        shutil.copytree(folders["whole"], folder)
        damage(folder)
        bad[name] = ["--checkpoint.initial_load_path", str(folder)]
    return bad


def test_bad_sources_are_refused_in_one_line_before_anything_is_written(
    folders, source, tmp_path, capsys
):
    sources = _damaged(folders, tmp_path)
    partial = tmp_path / "step-9"
    partial.mkdir()
    sources["no_metadata"] = ["--checkpoint.initial_load_path", str(partial)]
    sources["missing_folder"] = ["--checkpoint.initial_load_path", str(tmp_path / "nope")]
    (tmp_path / "a_file").write_text("{}")
    sources["a_file"] = ["--checkpoint.initial_load_path", str(tmp_path / "a_file")]
    sources["shape"] = [*sources["missing"][:0], "--checkpoint.initial_load_path",
                        str(folders["whole"]), "--model.flavor", "debug"]  # fmt: skip
    sources["vocab"] = ["--checkpoint.initial_load_path", str(folders["vocab"])]
    sources["hf_optimizer"] = [
        "--checkpoint.initial_load_path", str(folders["whole"]),
        "--checkpoint.initial_load_model_only", "false",
    ]  # fmt: skip
    key = "checkpoint.initial_load_path"
    expected = {
        "no_config": f"{key} '{tmp_path / 'no_config'}' has no config.json: give a Hugging Face",
        "no_weights": f"{key} '{tmp_path / 'no_weights'}' has no model.safetensors nor "
        "model.safetensors.index.json: give",
        "truncated": f"{key} '{tmp_path / 'truncated'}' has a damaged or missing "
        "model.safetensors (SafetensorError: Error while deserializing header",
        "missing": f"{key} '{tmp_path / 'missing'}' lacks 1 tensor(s) of the model: norm.weight;",
        "no_metadata": f"{key} '{partial}' has a damaged .metadata",
        "rope_theta": f"{key} '{tmp_path / 'rope_theta'}' has rope_theta 500000.0 in its "
        "config.json, but model.flavor's model has 10000.0",
        "bias": f"{key} '{tmp_path / 'bias'}': config.json field 'attention_bias' is True",
        "missing_folder": f"{key} '{tmp_path / 'nope'}' does not exist: give a Hugging Face",
        "a_file": f"{key} '{tmp_path / 'a_file'}' is a file, not a folder: give a Hugging Face",
        "shape": f"{key} '{folders['whole']}' holds another model shape: tensor "
        "'tok_embeddings.weight' is [2048, 32] there and [2048, 256] in model.flavor's model "
        "here; pick the model.flavor of its shape",
        "vocab": f"tokenizer '{TOKENIZER}' has 2048 tokens, but the embedding of {key} "
        f"'{folders['vocab']}' has 2056 rows: use the model's own tokenizer",
        "hf_optimizer": f"{key} '{folders['whole']}' is a Hugging Face folder, which holds no "
        "optimizer state",
    }
    for name, args in sources.items():
        dump = tmp_path / f"run-{name}"
        if name == "missing_folder":  # through the command line: exit 2, one line
            argv = [*_cli_args(dump), *args]
            assert run_cli(lambda argv=argv: Trainer(*configure(argv))) == 2
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"plugtrain: error: {expected[name]}"), line
        else:
            with pytest.raises(CheckpointError) as e:
                make_trainer(dump, *args)
            assert "\n" not in str(e.value)
            assert str(e.value).startswith(expected[name]), (name, str(e.value))
        assert not dump.exists(), name  # the failed start removed the folder it made


def _cli_args(dump: Path) -> list[str]:
    from plugtrain.testing import tiny_args

    return tiny_args(dump)


def test_a_local_dump_folder_names_its_latest_checkpoint_as_a_url_does(tmp_path):
    storage = LocalStorage(tmp_path / "checkpoints")
    save_small_checkpoint(storage, 2)
    save_small_checkpoint(storage, 4)
    for path in (tmp_path, storage.where(2)):
        config = CheckpointConfig(initial_load_path=str(path), initial_load_model_only=True)
        record = open_initial_load(config).record()
        step = 2 if path.name == "step-2" else 4
        assert (record["kind"], record["step"]) == ("plugtrain", step)
        assert record["path"] == str(storage.where(step).resolve())
