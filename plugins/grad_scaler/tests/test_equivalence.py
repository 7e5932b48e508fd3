"""The plugin against the canonical hand-written GradScaler loop, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from plugtrain.plugin import full_tensor, hookimpl, local_tensor
from plugtrain.testing import (
    InjectInf,
    Trainer,
    canonical_fp16_loop,
    grad_norm,
    make_trainer,
    read_metrics,
)

STEPS = 6
INF_STEPS = {2, 5}
FP16 = ("--training.mixed_precision_param", "float16")
TRAINING = (*FP16, "--training.grad_accum_steps", "2", "--lr_scheduler.warmup_steps", "2")
SCALER = ("--grad_scaler.growth_interval", "2")
MAX_NORM = 0.5


class GradNorms:
    """An observer (``observe_gradients``): records the global gradient norm it sees."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    @hookimpl
    def observe_gradients(self, ctx) -> None:
        self.norms.append(grad_norm(ctx.model))


def reference_loop(dump_folder, clip: bool) -> tuple[Trainer, list[float], list[float]]:
    """The kit's canonical loop (scale, backward, unscale_, [clip_grad_norm_], step, update) on
    the trainer's model, fused optimizer, schedule and data.

    Returns the trained trainer, the scale after each step and the norm after unscale_."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        trainer = make_trainer(dump_folder, *TRAINING, steps=STEPS)  # no plugins
    recipe = canonical_fp16_loop(
        trainer, STEPS, INF_STEPS, MAX_NORM if clip else None, growth_interval=2
    )
    return trainer, recipe.scales, recipe.norms


def check_against_reference(
    tmp_path, enabled: str = "grad_scaler", scaler_registered_first: bool = True
) -> Trainer:
    """Train through plugtrain with the ``enabled`` plugins (registered in that order) and
    compare with ``reference_loop``, clipping there too if grad_clip is enabled."""
    clip = "grad_clip" in enabled
    reader = GradNorms()
    others = [("inject", InjectInf(INF_STEPS)), ("reader", reader)]
    plugins = [(name, None) for name in enabled.split(",")]
    order = [*plugins, *others] if scaler_registered_first else [*others, *plugins]
    trainer = make_trainer(
        tmp_path / "plugin", *TRAINING, "--plugins.enabled", enabled, *SCALER,
        *(("--grad_clip.max_norm", str(MAX_NORM)) if clip else ()), steps=STEPS, plugins=order,
    )  # fmt: skip
    assert [n for n in trainer.host.names() if n.startswith("grad_")] == enabled.split(",")
    trainer.run()
    reference, ref_scales, ref_norms = reference_loop(tmp_path / "reference", clip)

    records = read_metrics(tmp_path / "plugin")
    assert [r["grad_scaler/loss_scale"] for r in records] == ref_scales
    assert ref_scales == [2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15]
    assert [r["grad_scaler/skipped_steps"] for r in records] == [0, 1, 1, 1, 2, 2]
    assert all(0 < n < 100 for i, n in enumerate(ref_norms, 1) if i not in INF_STEPS)
    assert int(trainer.lr_scheduler.applied_steps) == STEPS - len(INF_STEPS)
    assert trainer.optimizer.defaults["fused"]  # the scaler hands found_inf to its kernel
    if clip:  # grad_clip's pre-clip norm: it saw the unscaled gradients, and clipped them
        clean = [i for i in range(STEPS) if i + 1 not in INF_STEPS]
        clip_norms = [records[i]["grad_clip/grad_norm"] for i in clean]
        assert clip_norms == pytest.approx([ref_norms[i] for i in clean], rel=1e-6)
        assert min(clip_norms) > MAX_NORM
    else:  # an observer sees the unscaled gradients, in either order
        assert reader.norms == ref_norms
    named = trainer.model.named_parameters()
    for (name, got), want in zip(named, reference.model.parameters(), strict=True):
        assert torch.equal(full_tensor(got), full_tensor(want)), name
        got_state, want_state = trainer.optimizer.state[got], reference.optimizer.state[want]
        assert got_state.keys() == want_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in want_state.items():
            assert torch.equal(local_tensor(got_state[key]), local_tensor(value)), (name, key)
    return trainer


@pytest.mark.parametrize("scaler_registered_first", [True, False])
def test_bitwise_equal_to_the_canonical_loop(tmp_path, scaler_registered_first):
    check_against_reference(tmp_path, scaler_registered_first=scaler_registered_first)


@pytest.mark.parametrize("enabled", ["grad_scaler,grad_clip", "grad_clip,grad_scaler"])
def test_with_grad_clip_bitwise_equal_in_either_registration_order(tmp_path, enabled):
    """Scaler registered before or after the clipper: both equal the canonical loop with
    ``clip_grad_norm_`` between ``unscale_`` and ``step``, hence each other."""
    check_against_reference(tmp_path, enabled)
