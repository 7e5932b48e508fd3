"""dpo with the lora plugin's QLoRA base: the frozen targets held in NF4, the reference the
policy with its adapters off (the NF4 base itself, no second model)."""

from __future__ import annotations

import math

import pytest

from plugtrain.testing import SAMPLE, make_trainer

QLORA = (
    *("--plugins.enabled", "lora,dpo", "--lora.rank", "4", "--lora.base_dtype", "nf4"),
    # The tiny model's FFN weights at 512 x 32 hold one whole NF4 group of scales each.
    *("--lora.targets", "w1,w2,w3", "--model.ffn_dim", "512", "--dpo.reference", "adapters_off"),
)
PAIRS = ("--data.train_path", str(SAMPLE / "preference_train.jsonl"), "--training.seq_len", "256")


@pytest.mark.slow  # NF4 on the CPU: seconds
def test_dpo_trains_the_adapters_of_an_nf4_base_from_ln2(tmp_path):
    pytest.importorskip("torchao")
    fast = (
        "--training.batch_size",
        "2",
        "--optimizer.lr",
        "0.02",
        "--lr_scheduler.warmup_steps",
        "0",
    )
    trainer = make_trainer(tmp_path, *QLORA, *PAIRS, *fast, steps=3)
    held = {
        type(p).__name__ for n, p in trainer.model.named_parameters() if n.endswith("w1.weight")
    }
    assert held == {"NF4Tensor"}
    batch = trainer.batches.next_batch()
    losses = [trainer.train_step(batch)[0].item() for _ in range(3)]
    assert abs(losses[0] - math.log(2)) < 1e-6  # the adapters start at zero: policy = reference
    assert losses[2] < losses[1] < losses[0] - 1e-3, losses
    trainer.close()
