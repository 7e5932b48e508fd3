"""The optimizer: the core's fused AdamW and its param groups (``optimizer.no_decay``), and
one a plugin builds (``build_optimizer``)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from plugtrain.config import OptimizerConfig
from plugtrain.errors import CheckpointError, ConfigError, PluginError
from plugtrain.plugin import OptimizerContext, hookimpl
from plugtrain.testing import make_trainer
from plugtrain.training.optim import build_optimizer, describe_param_groups, lr_factor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def stepped(cfg: OptimizerConfig) -> tuple[Net, Net]:
    """A net before and after one AdamW step on zero gradients: only weight decay moves it."""
    torch.manual_seed(0)
    net = Net()
    before = Net()
    before.load_state_dict(net.state_dict())
    opt = build_optimizer(net, cfg, torch.device("cpu"))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return before, net


def test_no_decay_exempts_the_named_parameters_from_weight_decay_only():
    cfg = OptimizerConfig(lr=0.5, weight_decay=0.1, no_decay=["norm", "bias", "embeddings"])
    before, after = stepped(cfg)
    exempt = {"tok_embeddings.weight", "proj.bias", "norm.weight", "norm.bias"}
    for (name, p0), p1 in zip(before.named_parameters(), after.parameters(), strict=True):
        expected = p0 if name in exempt else p0 * (1 - 0.5 * 0.1)
        assert torch.equal(p1, expected), name
    # The default is one group, every parameter decayed (the run before the option existed).
    before, after = stepped(OptimizerConfig(lr=0.5, weight_decay=0.1))
    for p0, p1 in zip(before.parameters(), after.parameters(), strict=True):
        assert torch.equal(p1, p0 * (1 - 0.5 * 0.1))


def test_the_groups_are_described_in_one_line():
    opt = build_optimizer(Net(), OptimizerConfig(no_decay=["norm"]), torch.device("cpu"))
    assert describe_param_groups(opt) == (
        "AdamW, 2 param group(s): [0] 3 tensors, 40 params, weight_decay 0.1; "
        "[1] 2 tensors, 8 params, weight_decay 0.0"
    )
    assert [g["lr"] is not opt.param_groups[0]["lr"] for g in opt.param_groups] == [False, True]
    one = build_optimizer(Net(), OptimizerConfig(), torch.device("cpu"))
    assert describe_param_groups(one) == "AdamW, 1 param group(s): [0] 5 tensors, 48 params"


def test_a_name_part_that_matches_no_parameter_is_refused():
    with pytest.raises(ConfigError, match=r"^config key 'optimizer.no_decay' names 'nrom', "):
        build_optimizer(Net(), OptimizerConfig(no_decay=["nrom"]), torch.device("cpu"))
    with pytest.raises(ConfigError, match="must be distinct non-empty"):
        OptimizerConfig(no_decay=["norm", "norm"])


class TwoPeaks:
    """Builds fused AdamW with the embedding at a tenth of the other parameters' peak LR."""

    def __init__(self, lr: object = None) -> None:
        self.lr = lr

    @hookimpl
    def build_optimizer(self, ctx: OptimizerContext) -> torch.optim.Optimizer:
        embedding = [p for name, p in ctx.named_parameters if name == "tok_embeddings.weight"]
        others = [p for name, p in ctx.named_parameters if name != "tok_embeddings.weight"]
        return torch.optim.AdamW(
            [
                {"params": others, "lr": ctx.learning_rate(2e-3) if self.lr is None else self.lr},
                {"params": embedding, "lr": ctx.learning_rate(2e-4)},
            ],
            fused=True,
        )


def test_a_plugins_optimizer_is_scheduled_group_by_group_and_resumed_only_by_it(tmp_path, capsys):
    ckpt = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")
    trainer = make_trainer(tmp_path, *ckpt, steps=2, plugins=[("two_peaks", TwoPeaks())])
    trainer.run()
    log = capsys.readouterr().err
    assert (
        "optimizer (two_peaks): AdamW, 2 param group(s): [0] 20 tensors, 90,272 params; [1] 1"
        in log
    )
    factor = lr_factor(torch.tensor(2), trainer.config.lr_scheduler, 2)
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    assert torch.equal(torch.stack(lrs), (torch.tensor([2e-3, 2e-4]) * factor).float())
    # Resuming its checkpoint with the core's AdamW (one group) is refused in one line.
    with pytest.raises(CheckpointError, match="holds the state of another optimizer") as error:
        make_trainer(tmp_path, *ckpt, steps=3)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ([("a", TwoPeaks()), ("b", TwoPeaks())], "plugins 'a' and 'b' both build the optimizer"),
        ([("a", TwoPeaks(lr=1e-3))], "plugin 'a': its optimizer's param group 0 has lr 0.001;"),
    ],
)
def test_optimizers_that_break_the_hooks_contract_are_refused(tmp_path, plugins, message):
    with pytest.raises(PluginError, match=re.escape(message)):
        make_trainer(tmp_path, plugins=plugins)
