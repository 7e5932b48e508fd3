"""A loss one plugin answers (``build_loss``): normalised by the step's units, counted once per
step over every microbatch and rank, never as a mean of per-microbatch means."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from plugtrain.distributed import ParallelDims
from plugtrain.errors import PluginError
from plugtrain.plugin import IGNORE_INDEX, MicroBatch, SetupContext, hookimpl
from plugtrain.testing import SAMPLE, make_trainer, read_metrics
from plugtrain.training.loss import PluginLoss

CHAT = ("--data.train_path", str(SAMPLE / "chat_train.jsonl"), "--training.seq_len", "96",
        "--training.batch_size", "8", "--training.grad_accum_steps", "4")  # fmt: skip


class TokenLoss:
    """The cross-entropy again, as a plugin answers it: units are the counted targets, each
    microbatch's loss their summed cross-entropy."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    @hookimpl
    def build_loss(self, ctx: SetupContext) -> TokenLoss:
        return self

    def units(self, microbatch: MicroBatch) -> torch.Tensor:
        return (microbatch.targets != IGNORE_INDEX).sum()

    def __call__(self, model: torch.nn.Module, microbatch: MicroBatch, index: int):
        self.calls.append(index)
        logits = model(microbatch.inputs, **microbatch.model_inputs())
        return F.cross_entropy(
            logits.flatten(0, 1).float(), microbatch.targets.flatten(), reduction="sum"
        )


def losses(folder) -> list[float]:
    return [r["loss"] for r in read_metrics(folder) if "loss" in r]


def test_a_plugin_loss_is_normalised_by_the_steps_units_over_unequal_microbatches(tmp_path):
    plain = make_trainer(tmp_path / "plain", *CHAT)
    # The chat microbatches hold unequal numbers of counted targets: a per-microbatch mean
    # would weigh them otherwise (tests/test_chat_loss.py shows it differs).
    counts = {int((m.targets != IGNORE_INDEX).sum()) for m in plain.batches.next_batch()}
    assert len(counts) > 1, counts
    plain.close()
    plain = make_trainer(tmp_path / "plain2", *CHAT)
    plain.run()
    answer = TokenLoss()
    answered = make_trainer(tmp_path / "answered", *CHAT, plugins=[("tokens", answer)])
    answered.run()
    assert answer.calls == [0, 1, 2, 3] * 3
    for mine, theirs in zip(
        losses(tmp_path / "answered"), losses(tmp_path / "plain2"), strict=True
    ):
        assert math.isclose(mine, theirs, rel_tol=1e-6), (mine, theirs)
    for a, b in zip(answered.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class NotALoss:
    @hookimpl
    def build_loss(self, ctx: SetupContext) -> str:
        return "loss"


class Term:
    @hookimpl
    def loss_terms(self, ctx):
        return None


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ([("a", TokenLoss()), ("b", TokenLoss())], "plugins 'a' and 'b' both answer the loss"),
        ([("odd", NotALoss())], "plugin 'odd': build_loss returned a str, not a StepLoss"),
        (
            [("tokens", TokenLoss()), ("term", Term())],
            "plugin 'tokens' answers the loss, so 'term' cannot add loss terms",
        ),
    ],
)
def test_a_second_answer_a_wrong_one_or_loss_terms_beside_one_are_refused(
    tmp_path, plugins, message
):
    with pytest.raises(PluginError, match=message):
        make_trainer(tmp_path, plugins=plugins)


class Copier:
    """Takes a frozen copy of the model in setup, as a loss plugin's reference."""

    def __init__(self) -> None:
        self.copy: torch.nn.Module | None = None

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.copy = ctx.frozen_copy()


def test_a_frozen_copy_holds_the_starting_weights_in_storage_of_its_own(tmp_path):
    copier = Copier()
    trainer = make_trainer(tmp_path, plugins=[("copier", copier)])
    start = [p.detach().clone() for p in trainer.model.parameters()]
    copies = list(copier.copy.parameters())
    assert len(copies) == len(start)
    assert all(
        torch.equal(c, s) and not c.requires_grad for c, s in zip(copies, start, strict=True)
    )
    trainer.run()
    assert all(torch.equal(c, s) for c, s in zip(copies, start, strict=True))
    assert not torch.equal(next(trainer.model.parameters()), start[0])


def test_validation_computes_a_plugin_loss_over_the_units_of_its_batches(tmp_path):
    validation = ("--validation.interval", "3", "--validation.steps", "2",
                  "--data.validation_path", str(SAMPLE / "chat_validation.jsonl"))  # fmt: skip
    make_trainer(tmp_path / "plain", *CHAT, *validation).run()
    make_trainer(tmp_path / "answered", *CHAT, *validation, plugins=[("t", TokenLoss())]).run()
    (plain,) = [r for r in read_metrics(tmp_path / "plain") if "validation_loss" in r]
    (answered,) = [r for r in read_metrics(tmp_path / "answered") if "validation_loss" in r]
    # The cross-entropy again, as a plugin answers it: the mean over the counted targets.
    assert math.isclose(answered["validation_loss"], plain["validation_loss"], rel_tol=1e-6)
    assert "validation_bpb" in plain and "validation_bpb" not in answered


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        (
            {"pp": 2},
            "plugin 'tokens' answers the loss, which does not run under pipeline parallelism "
            "yet (parallelism.pp = 2): set parallelism.pp = 1",
        ),
        (
            {"cp": 2, "dp_shard": 2},
            "plugin 'tokens' answers the loss, which does not run under context parallelism "
            "yet (parallelism.cp = 2): set parallelism.cp = 1",
        ),
    ],
)
def test_a_plugins_loss_is_refused_where_no_rank_runs_whole_sequences(degrees, message):
    loss = PluginLoss.of({"tokens": TokenLoss()}, None)
    assert loss is not None
    loss.refuse_split(ParallelDims())  # one process: nothing refused
    with pytest.raises(PluginError) as refused:
        loss.refuse_split(ParallelDims(**degrees))
    assert str(refused.value) == message
