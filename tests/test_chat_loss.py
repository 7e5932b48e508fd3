"""The loss on chat data: the assistant's tokens only, as transformers computes it with labels
-100, and averaged over the tokens of the whole optimizer step (every microbatch, every rank)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from plugtrain.cli import main
from plugtrain.data import IGNORE_INDEX
from plugtrain.model import cross_entropy
from plugtrain.testing import SAMPLE, make_trainer, tiny_run
from plugtrain.testing.hf import hf_chat_tokenizer, hf_llama_folder

transformers = pytest.importorskip("transformers")

CHAT_TRAIN, CHAT_VALIDATION = SAMPLE / "chat_train.jsonl", SAMPLE / "chat_validation.jsonl"


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random HF Llama whose tokenizer has a Llama 3 style chat template and its tokens."""
    folder = tmp_path_factory.mktemp("chat_llama")
    hf_llama_folder(folder, tokenizer=False, vocab_size=2053)
    return hf_chat_tokenizer(folder, "llama3")


@pytest.mark.slow  # transformers and an HF folder: seconds
def test_the_masked_loss_is_the_assistant_tokens_mean_as_transformers_computes_it(
    tmp_path: Path, chat_llama: Path
) -> None:
    trainer = make_trainer(
        tmp_path / "run",
        *("--model.flavor", "hf", "--checkpoint.initial_load_path", str(chat_llama)),
        *("--model.tokenizer_path", "", "--data.train_path", str(CHAT_VALIDATION)),
        *("--data.shuffle", "false", "--training.batch_size", "2", "--training.seq_len", "64"),
        # Set explicitly, causal stays: transformers' loss below is that of the packed rows.
        *("--model.attention", "causal"),
    )
    batch = trainer.batches.next_batch()
    ((inputs, targets, documents, *_),) = batch
    assert documents is None and trainer.config.data.reset_positions is False
    data = trainer.train_data
    counted = torch.stack([torch.from_numpy(data.counted(i)) for i in (0, 1)]).bool()
    assert 0 < counted.sum() < counted.numel()  # some tokens count, not all
    assert (targets == IGNORE_INDEX).equal(~counted)
    hf = transformers.LlamaForCausalLM.from_pretrained(chat_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(inputs).logits
        # By hand: the mean over the counted targets of -log p(target).
        picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1))[..., 0]
        by_hand = -picked[counted].mean()
        # transformers: the whole samples as input, labels -100 where the target does not count.
        tokens = torch.stack([torch.from_numpy(data.tokens(i).astype("int64")) for i in (0, 1)])
        labels = torch.cat([torch.full((2, 1), IGNORE_INDEX), targets], dim=1)
        theirs = hf(tokens, labels=labels).loss
        every_token = cross_entropy(logits, torch.from_numpy(tokens[:, 1:].numpy()))
    loss, _ = trainer.train_step(batch)
    assert abs(loss.item() - by_hand.item()) < 1e-5
    assert abs(loss.item() - theirs.item()) < 1e-5
    assert abs(loss.item() - every_token.item()) > 1e-2  # the mask changed the loss
    trainer.close()


def _run(folder: Path, world_size: int, grad_accum: int) -> dict[int, float]:
    result = tiny_run(
        folder,
        *("--data.train_path", str(CHAT_TRAIN), "--data.validation_path", str(CHAT_VALIDATION)),
        *("--training.grad_accum_steps", str(grad_accum), "--validation.interval", "3"),
        *("--validation.steps", "2", "--training.batch_size", "8", "--training.seq_len", "96"),
        world_size=world_size,
    )
    (validation,) = [r["validation_loss"] for r in result.metrics if "validation_loss" in r]
    # Chat data resolved the default attention: packed conversations do not see each other.
    model = json.loads((folder / "config.json").read_text())["model"]
    assert model["attention"] == "document"
    return {**result.losses, 0: validation}


@pytest.mark.slow
def test_the_loss_is_a_mean_over_the_whole_steps_tokens_on_any_split(tmp_path: Path) -> None:
    """One process with the whole batch of 8 and two processes of two microbatches of 2 each
    train the same: each microbatch's loss is its sum over assistant tokens divided by the
    step's count over all of them. The per-microbatch mean (the classic bug) weights the tokens
    of microbatches with few assistant tokens more: its first loss, computed below on the same
    microbatches, differs, and so would the gradient and every later loss."""
    whole = _run(tmp_path / "one", world_size=1, grad_accum=1)
    split = _run(tmp_path / "two", world_size=2, grad_accum=2)
    assert whole.keys() == split.keys() == {0, 1, 2, 3}
    for step in whole:  # 0: the validation loss, over the assistant tokens of 2 batches
        assert math.isclose(whole[step], split[step], rel_tol=1e-5), (step, whole, split)
    # The same first step's four microbatches of 2: unequal counts, another mean per microbatch.
    trainer = make_trainer(
        tmp_path / "check",
        *("--data.train_path", str(CHAT_TRAIN), "--training.batch_size", "8"),
        *("--training.grad_accum_steps", "4", "--training.seq_len", "96"),
    )
    batch = trainer.batches.next_batch()
    counts = [int((m.targets != IGNORE_INDEX).sum()) for m in batch]
    assert len(set(counts)) > 1, counts
    with torch.no_grad():
        means = [cross_entropy(trainer.model(m.inputs), m.targets).item() for m in batch]
    per_microbatch = sum(means) / len(means)
    token_mean = sum(m * n for m, n in zip(means, counts, strict=True)) / sum(counts)
    assert math.isclose(token_mean, whole[1], rel_tol=1e-5)
    assert abs(per_microbatch - whole[1]) > 1e-3
    trainer.close()


@pytest.mark.slow
def test_the_recipe_fine_tunes_an_hf_llama_on_chat_data_and_exports_it(
    tmp_path: Path, chat_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/fine-tuning.md's recipe: initial_load_path from an HF folder, chat JSONL, export-hf,
    generate --chat; transformers loads the export and applies its chat template."""
    run = tmp_path / "run"
    tiny_run(
        run,
        *("--model.flavor", "hf", "--checkpoint.initial_load_path", str(chat_llama)),
        *("--model.tokenizer_path", "", "--data.train_path", str(CHAT_TRAIN)),
        *("--checkpoint.enable", "true", "--training.seq_len", "64"),
        steps=2,
    )
    out = tmp_path / "export"
    assert main(["export-hf", str(run), "-o", str(out), "--dtype", "float32"]) == 0
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoTokenizer.from_pretrained(chat_llama)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == theirs.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model(torch.tensor([ids])).logits.isfinite().all()
    capsys.readouterr()
    args = [str(out), "--prompt", messages[0]["content"], "--chat", "--max-new-tokens", "4"]
    assert main(["generate", *args, "--device", "cpu"]) == 0
    assert capsys.readouterr().out.endswith("\n")
