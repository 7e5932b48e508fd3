"""MuonAdamW against torch's own optimizers, on unsharded tensors: the same bits."""

from __future__ import annotations

import pytest
import torch
from plugtrain_muon import MuonAdamW


def params() -> list[torch.nn.Parameter]:
    """Two matrices (one tall, one wide: both orientations of the iteration) and a vector."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (8, 20), (16,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def grads(step: int, like: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in like]


@pytest.mark.parametrize(
    ("adjust_lr_fn", "nesterov"), [("original", True), ("match_rms_adamw", False)]
)
def test_muon_adamw_equals_torch_muon_and_fused_adamw_over_10_steps(adjust_lr_fn, nesterov):
    ours, theirs = params(), params()
    muon = {"lr": torch.tensor(0.02), "weight_decay": 0.1, "momentum": 0.95,
            "nesterov": nesterov, "ns_steps": 5, "eps": 1e-7}  # fmt: skip
    adamw = {"lr": torch.tensor(3e-3), "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    optimizer = MuonAdamW(
        [{"params": ours[:2], **muon}], [{"params": ours[2:], **adamw}], adjust_lr_fn=adjust_lr_fn
    )
    reference = [
        torch.optim.Muon(theirs[:2], lr=0.02, weight_decay=0.1, momentum=0.95,
                         nesterov=nesterov, adjust_lr_fn=adjust_lr_fn),
        torch.optim.AdamW(theirs[2:], fused=True, **adamw),
    ]  # fmt: skip
    for step in range(10):
        for ps in (ours, theirs):
            for p, g in zip(ps, grads(step, ps), strict=True):
                p.grad = g
        optimizer.step()
        for opt in reference:
            opt.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    ours_state = [optimizer.state[p] for p in ours]
    assert torch.equal(
        ours_state[0]["momentum_buffer"], reference[0].state[theirs[0]]["momentum_buffer"]
    )
    assert torch.equal(ours_state[2]["exp_avg_sq"], reference[1].state[theirs[2]]["exp_avg_sq"])


def test_a_found_inf_step_changes_no_parameter_and_no_state():
    ps = params()
    muon = {"lr": torch.tensor(0.02), "weight_decay": 0.1, "momentum": 0.95,
            "nesterov": True, "ns_steps": 5, "eps": 1e-7}  # fmt: skip
    optimizer = MuonAdamW(
        [{"params": ps[:2], **muon}], [{"params": ps[2:], "lr": torch.tensor(1e-3)}]
    )
    for p, g in zip(ps, grads(0, ps), strict=True):
        p.grad = g
    optimizer.step()
    before = (
        [p.clone() for p in ps],
        [v.clone() for s in optimizer.state.values() for v in s.values()],
    )
    for p in ps:
        p.grad = torch.full_like(p, float("inf"))
    optimizer.found_inf, optimizer.grad_scale = torch.tensor(1.0), None
    optimizer.step()
    after = ps, [v for s in optimizer.state.values() for v in s.values()]
    for a, b in zip([*before[0], *before[1]], [*after[0], *after[1]], strict=True):
        assert torch.equal(a, b)
    optimizer.found_inf = torch.tensor(0.0)
    for p, g in zip(ps, grads(1, ps), strict=True):
        p.grad = g
    optimizer.step()
    assert not any(torch.equal(a, b) for a, b in zip(before[0], ps, strict=True))


def test_a_stack_of_matrices_steps_as_its_matrices_one_by_one():
    """A layer's experts, ``[experts, out, in]``: each expert's matrix orthogonalised on its
    own (batched), the same bits as separate matrices; both orientations."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 24, 16), (3, 8, 20)]:
        stack = torch.nn.Parameter(torch.randn(shape, generator=gen))
        matrices = [torch.nn.Parameter(m.clone()) for m in stack.detach().unbind()]
        muon = {"lr": torch.tensor(0.02), "weight_decay": 0.1, "momentum": 0.95,
                "nesterov": True, "ns_steps": 5, "eps": 1e-7}  # fmt: skip
        stacked = MuonAdamW([{"params": [stack], **muon}], [])
        separate = MuonAdamW([{"params": matrices, **muon}], [])
        for step in range(3):
            (grad,) = grads(step, [stack])
            stack.grad = grad
            for m, g in zip(matrices, grad.unbind(), strict=True):
                m.grad = g.clone()
            stacked.step()
            separate.step()
        assert torch.equal(stack.detach(), torch.stack([m.detach() for m in matrices]))
