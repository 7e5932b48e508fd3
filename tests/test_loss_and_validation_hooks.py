"""The hooks around the step: loss terms, validation on other weights, checkpoint events."""

from __future__ import annotations

import math

import pytest
import torch

from plugtrain.errors import PluginError
from plugtrain.plugin import (
    LossContext,
    SetupContext,
    StepContext,
    ValidationContext,
    hookimpl,
    local_tensor,
)
from plugtrain.testing import SAMPLE, make_trainer, parameter_checksums, read_metrics

VALIDATION = ("--validation.interval", "2", "--validation.steps", "1",
              "--data.validation_path", str(SAMPLE / "validation.jsonl"))  # fmt: skip


class LossProbe:
    """Keeps the loss each microbatch's backward would run on, as ``pre_backward`` sees it."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        self.losses.append(ctx.loss.detach().clone())


class ConstantTerm:
    """A loss term worth ``value`` a step with a zero gradient (it goes through the logits):
    each microbatch returns its share, its counted targets over the step's count."""

    def __init__(self, value: float | list[float]) -> None:
        self.value = value
        self.lse_shapes: list[tuple[int, ...]] = []

    @hookimpl
    def loss_terms(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        assert ctx.lse is ctx.lse  # computed once
        self.lse_shapes.append(tuple(ctx.lse.shape))
        assert ctx.logits.requires_grad and ctx.targets.shape == ctx.lse.shape
        share = ctx.mask.sum() / ctx.count
        return {"constant": ctx.lse.sum() * 0 + torch.tensor(self.value) * share}


def train(folder, *args, plugins=(), steps=3):
    trainer = make_trainer(folder, *args, steps=steps, plugins=plugins)
    trainer.run()
    return trainer


def test_loss_terms_are_added_before_pre_backward_and_logged_on_their_own(tmp_path):
    accum = ("--training.grad_accum_steps", "2")
    plain_probe, probe, term = LossProbe(), LossProbe(), ConstantTerm(3.0)
    plain = train(tmp_path / "plain", *accum, plugins=[("probe", plain_probe)])
    added = train(tmp_path / "added", *accum, plugins=[("probe", probe), ("term", term)])
    # Each microbatch's loss gains its share of the term: text counts every target, so half.
    assert [t.item() for t in probe.losses] == [t.item() + 1.5 for t in plain_probe.losses]
    assert term.lse_shapes == [(2, 32)] * 6  # batch 4 in 2 microbatches, seq_len 32
    records = [r for r in read_metrics(tmp_path / "added") if "loss" in r]
    plain_records = [r for r in read_metrics(tmp_path / "plain") if "loss" in r]
    assert [r["term/constant"] for r in records] == [3.0] * 3  # the step's, its shares' sum
    assert [r["loss"] for r in records] == [r["loss"] for r in plain_records]  # still the CE
    assert parameter_checksums(added.model) == parameter_checksums(plain.model)  # zero gradient


def test_a_loss_term_that_is_not_a_scalar_is_an_error_naming_the_plugin(tmp_path):
    trainer = make_trainer(tmp_path, plugins=[("bad", ConstantTerm([1.0, 2.0]))])
    with pytest.raises(PluginError, match=r"plugin 'bad': loss_terms returned 'constant'"):
        trainer.train_step(trainer.batches.next_batch())
    trainer.close()


class ZeroWeights:
    """Offers the weight set "zeros": every parameter shard zero, swapped in and back."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, float | None]] = []
        self.saved: list[torch.Tensor] = []
        self.params: tuple = ()

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.params = tuple(ctx.model.parameters())

    @hookimpl
    def validation_weights(self) -> list[str]:
        return ["zeros"]

    @hookimpl
    @torch.no_grad()
    def pre_validation(self, ctx: ValidationContext) -> None:
        self.seen.append(("pre", ctx.weights, ctx.loss))
        if ctx.weights == "zeros":
            self.saved = [local_tensor(p).clone() for p in self.params]
            for p in self.params:
                local_tensor(p).zero_()

    @hookimpl
    @torch.no_grad()
    def post_validation(self, ctx: ValidationContext) -> None:
        self.seen.append(("post", ctx.weights, ctx.loss))
        if ctx.weights == "zeros":
            for p, saved in zip(self.params, self.saved, strict=True):
                local_tensor(p).copy_(saved)


class WeightProbe:
    """Reports, at each validation pass, the sum of the magnitudes of the weights in place."""

    def __init__(self) -> None:
        self.params: tuple = ()

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.params = tuple(ctx.model.parameters())

    @hookimpl
    def validation_metrics(self, ctx: ValidationContext) -> dict[str, torch.Tensor | str]:
        magnitude = sum(local_tensor(p).abs().sum() for p in self.params)
        return {"magnitude": magnitude, "weights": str(ctx.weights)}


def test_each_offered_weight_set_is_validated_between_the_hooks_and_swapped_back(tmp_path):
    plain = train(tmp_path / "plain", *VALIDATION)
    swap = ZeroWeights()
    # The probe registered first and last: it measures each pass's weights either way.
    probes = [("a_probe", WeightProbe()), ("zero", swap), ("z_probe", WeightProbe())]
    swapped = train(tmp_path / "swapped", *VALIDATION, plugins=probes)
    records = [r for r in read_metrics(tmp_path / "swapped") if "validation_loss" in r]
    plain_records = [r for r in read_metrics(tmp_path / "plain") if "validation_loss" in r]
    for record in records:
        for probe in ("a_probe", "z_probe"):
            assert record.pop(f"zeros/{probe}/magnitude") == 0  # the zero set was in place
            assert record.pop(f"{probe}/magnitude") > 0
            assert record.pop(f"{probe}/weights") == "None"
            assert record.pop(f"zeros/{probe}/weights") == "zeros"
    keys = {"validation_loss", "validation_bpb"}
    assert [set(r) for r in records] == [{"step", *keys, *(f"zeros/{k}" for k in keys)}] * 2
    # Zero weights give zero logits: the loss is log(vocabulary) whatever FSDP2 kept gathered,
    # and the bits per byte are log2(vocabulary) over the bytes per token.
    for record in records:
        assert record["zeros/validation_loss"] == pytest.approx(math.log(2048), abs=1e-5)
        bytes_per_token = 11 / record["zeros/validation_bpb"]
        ratio = record["validation_loss"] / record["validation_bpb"] / math.log(2)
        assert ratio == pytest.approx(bytes_per_token, rel=1e-5)  # the same batches' bytes
    assert [r["validation_loss"] for r in records] == [r["validation_loss"] for r in plain_records]
    losses = [r["loss"] for r in read_metrics(tmp_path / "swapped") if "loss" in r]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "plain") if "loss" in r]
    assert parameter_checksums(swapped.model) == parameter_checksums(plain.model)
    assert [(when, weights) for when, weights, _ in swap.seen] == [
        ("pre", None), ("post", None), ("pre", "zeros"), ("post", "zeros")
    ] * 2  # fmt: skip
    assert swap.seen[1][2] == records[0]["validation_loss"]  # post_validation sees the loss


class CheckpointEvents:
    """Records each checkpoint event and whether the folder was complete then."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, bool]] = []

    @hookimpl
    def checkpoint_saved(self, folder, step: int) -> None:
        self.events.append(("saved", folder.name, step, (folder / ".metadata").is_file()))

    @hookimpl
    def checkpoint_loaded(self, folder, step: int) -> None:
        self.events.append(("loaded", folder.name, step, (folder / ".metadata").is_file()))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_checkpoint_events_fire_once_the_folder_is_complete(tmp_path, mode):
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "2",
            "--checkpoint.async_mode", mode)  # fmt: skip
    first = CheckpointEvents()
    train(tmp_path, *args, plugins=[("events", first)], steps=4)
    assert first.events == [("saved", "step-2", 2, True), ("saved", "step-4", 4, True)]
    resumed = CheckpointEvents()
    train(tmp_path, *args, plugins=[("events", resumed)], steps=5)
    assert resumed.events == [("loaded", "step-4", 4, True), ("saved", "step-5", 5, True)]
