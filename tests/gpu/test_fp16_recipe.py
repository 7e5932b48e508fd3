"""fp16 on CUDA: the grad_scaler and grad_clip plugins against the canonical recipe, bit for bit.

The recipe is written out (the kit's :func:`canonical_fp16_loop`: ``torch.amp.GradScaler``
on CUDA, ``clip_grad_norm_``, the fused AdamW), infs are injected into the gradients at two
steps, and the parameters, the optimizer state, the loss scales and the skipped steps must be
those of plugtrain's step with both plugins.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from plugtrain.plugin import full_tensor, local_tensor
from plugtrain.testing import InjectInf, canonical_fp16_loop, make_trainer, read_metrics

STEPS = 6
INF_STEPS = {2, 5}
MAX_NORM = 0.5
TRAINING = (
    "--training.mixed_precision_param", "float16",
    "--training.grad_accum_steps", "2",
    "--lr_scheduler.warmup_steps", "2",
)  # fmt: skip


def test_scaler_and_clip_equal_the_canonical_recipe_bitwise(
    tmp_path, device, device_args, deterministic
):
    trainer = make_trainer(
        tmp_path / "plugins", *device_args, *TRAINING,
        "--plugins.enabled", "grad_clip,grad_scaler", "--grad_scaler.growth_interval", "2",
        "--grad_clip.max_norm", str(MAX_NORM),
        steps=STEPS, plugins=[("inject", InjectInf(INF_STEPS))],
    )  # fmt: skip
    assert trainer.device.type == device.type
    trainer.run()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        reference = make_trainer(tmp_path / "reference", *device_args, *TRAINING, steps=STEPS)
    recipe = canonical_fp16_loop(reference, STEPS, INF_STEPS, MAX_NORM, growth_interval=2)

    records = read_metrics(tmp_path / "plugins")
    assert [r["grad_scaler/loss_scale"] for r in records] == recipe.scales
    assert recipe.scales == [2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15]
    assert [r["grad_scaler/skipped_steps"] for r in records] == [0, 1, 1, 1, 2, 2]
    assert int(trainer.lr_scheduler.applied_steps) == STEPS - len(INF_STEPS)
    assert trainer.optimizer.defaults["fused"]
    clean = [i for i in range(STEPS) if i + 1 not in INF_STEPS]
    clip_norms = [records[i]["grad_clip/grad_norm"] for i in clean]
    # grad_clip's fp32 norm on the device, the recipe's summed on the host: equal to rounding
    assert clip_norms == pytest.approx([recipe.norms[i] for i in clean], rel=1e-6)
    assert min(clip_norms) > MAX_NORM  # every clean step clipped
    named = trainer.model.named_parameters()
    for (name, got), want in zip(named, reference.model.parameters(), strict=True):
        assert got.device.type == device.type, name
        assert torch.equal(full_tensor(got), full_tensor(want)), name
        got_state, want_state = trainer.optimizer.state[got], reference.optimizer.state[want]
        assert got_state.keys() == want_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in want_state.items():
            assert torch.equal(local_tensor(got_state[key]), local_tensor(value)), (name, key)
