"""lora with what a user combines it with: the other plugins, fp16, FSDP2 and HSDP from a
Hugging Face Llama folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plugtrain.plugin import full_tensor
from plugtrain.testing import hf_llama_folder, make_trainer, read_metrics, run_distributed

LORA = ("--plugins.enabled", "lora", "--lora.rank", "4", "--lora.alpha", "8")


def losses(folder: Path | str) -> list[float]:
    return [r["loss"] for r in read_metrics(folder) if "loss" in r]


def base_unchanged(trainer, before: dict[str, torch.Tensor]) -> bool:
    params = dict(trainer.model.named_parameters())
    return all(torch.equal(full_tensor(params[n]), t) for n, t in before.items())


def frozen(trainer) -> dict[str, torch.Tensor]:
    return {
        n: full_tensor(p).detach().clone()
        for n, p in trainer.model.named_parameters()
        if not p.requires_grad
    }


@pytest.mark.slow
def test_grad_clip_ema_and_activation_checkpointing_cover_the_adapters(tmp_path):
    plain = make_trainer(tmp_path / "plain", *LORA)
    plain.run()
    extra = ("--plugins.enabled", "lora,grad_clip,ema,activation_checkpointing")
    trainer = make_trainer(tmp_path / "all", *LORA, *extra, "--grad_clip.max_norm", "1e9")
    before = frozen(trainer)
    trainer.run()
    assert base_unchanged(trainer, before)
    # Clipping that never clips and recomputed activations change no number.
    assert losses(tmp_path / "all") == losses(tmp_path / "plain")
    adapters = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(".lora_" in n for n in adapters)
    assert sorted(trainer.host.get("ema").average) == adapters
    norms = [r["grad_clip/grad_norm"] for r in read_metrics(tmp_path / "all") if "loss" in r]
    assert all(n > 0 for n in norms)


@pytest.mark.slow
def test_chat_data_with_document_masking_trains_the_adapters_only(tmp_path):
    chat = ("--data.train_path", "sample:chat_train.jsonl", "--training.seq_len", "128")
    trainer = make_trainer(tmp_path, *LORA, *chat, steps=2)
    assert trainer.config.model.attention == "document" and trainer.train_data.loss_mask
    before = frozen(trainer)
    trainer.run()
    assert base_unchanged(trainer, before)
    assert all(torch.isfinite(torch.tensor(losses(tmp_path))))


@pytest.mark.slow
def test_fp16_with_the_loss_scaler_trains_the_adapters_only(tmp_path):
    fp16 = ("--training.mixed_precision_param", "float16", "--plugins.enabled", "lora,grad_scaler")
    trainer = make_trainer(tmp_path, *LORA, *fp16)
    before = frozen(trainer)
    b = "layers.0.attention.wq.lora_b"
    trainer.run()
    assert base_unchanged(trainer, before)
    assert full_tensor(dict(trainer.model.named_parameters())[b]).abs().max() > 0
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert records[-1]["grad_scaler/skipped_steps"] == 0
    assert all(torch.isfinite(torch.tensor(losses(tmp_path))))


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_ones(tmp_path):
    eager = make_trainer(tmp_path / "eager", *LORA)
    eager.run()
    compiled = ("--plugins.enabled", "lora,compile", "--compile.backend", "aot_eager")
    make_trainer(tmp_path / "compiled", *LORA, *compiled).run()
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)


def hf_run(root: str, folder: str, *args: str) -> tuple[list[float], bool]:
    """A 10-step fp32 LoRA run from Hugging Face folder ``folder``: its losses, and whether
    every base weight is bitwise as loaded."""
    initial = ("--model.flavor", "hf", "--checkpoint.initial_load_path", folder)
    # grad_clip clips every step's adapters' gradients; grad_scaler stays inactive in fp32.
    clipped = ("--plugins.enabled", "lora,grad_clip,grad_scaler", "--grad_clip.max_norm", "0.05")
    trainer = make_trainer(
        root, *LORA, *clipped, *initial, "--model.tokenizer_path", "", *args, steps=10
    )
    before = frozen(trainer)
    trainer.run()
    return losses(root), base_unchanged(trainer, before)


def two_ranks(root: str, folder: str) -> dict[str, tuple[list[float], bool]]:
    """On each of 2 ranks: FSDP2 over both, HSDP (2 replicas of 1 shard), then tensor
    parallelism (the adapters split as their base weights are)."""
    return {
        "fsdp": hf_run(f"{root}/fsdp", folder),
        "hsdp": hf_run(f"{root}/hsdp", folder, "--parallelism.dp_replicate", "2"),
        "tp": hf_run(f"{root}/tp", folder, "--parallelism.tp", "2"),
    }


@pytest.mark.slow
def test_two_processes_train_as_one_from_a_hugging_face_folder(tmp_path):
    folder = str(hf_llama_folder(tmp_path / "hf"))
    one, unchanged = hf_run(str(tmp_path / "one"), folder)
    assert unchanged
    ranks = run_distributed(two_ranks, 2, str(tmp_path / "two"), folder)
    for layout in ("fsdp", "hsdp", "tp"):
        two, unchanged = ranks[0][layout]
        assert len(two) == 10 and unchanged and ranks[1][layout][1], layout
        assert two == pytest.approx(one, rel=1e-5), layout
