"""The core's optimizer: fused AdamW's parameter groups (``optimizer.no_decay``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plugtrain.config import OptimizerConfig
from plugtrain.errors import ConfigError
from plugtrain.training.optim import build_optimizer, describe_param_groups


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
