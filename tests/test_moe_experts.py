"""The routed experts' grouped GEMMs against one ``F.linear`` MLP per expert."""

import pytest
import torch
import torch.nn.functional as F

from plugtrain.model.moe import experts
from plugtrain.model.moe.experts import GroupedExperts

COUNTS = [3, 0, 5, 2]  # expert 1 gets no token


def per_expert(m: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = []
    for e, rows in enumerate(x.split(counts)):
        gate, up = F.linear(rows, m.w1[e]), F.linear(rows, m.w3[e])
        out.append(F.linear(F.silu(gate) * up, m.w2[e]))
    return torch.cat(out)


def forward_backward(m: GroupedExperts, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad()
    x = x.detach().requires_grad_()
    y = m(x, torch.tensor(COUNTS))
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_loop_bitwise(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    m = GroupedExperts(len(COUNTS), 8, 16).to(dtype)  # rows of 16 bytes: the grouped kernel
    x = torch.randn(sum(COUNTS), 8, dtype=dtype)
    grad = torch.randn(sum(COUNTS), 8, dtype=dtype)
    grouped = forward_backward(m, x, grad)
    monkeypatch.setattr(experts, "HAS_GROUPED_MM", False)
    looped = forward_backward(m, x, grad)
    assert all(torch.equal(a, b) for a, b in zip(grouped, looped, strict=True))
    w1_grad = grouped[2]
    assert w1_grad[0].abs().sum() > 0 and torch.equal(w1_grad[1], torch.zeros_like(w1_grad[1]))


def test_unaligned_rows_take_the_loop() -> None:
    torch.manual_seed(0)
    m = GroupedExperts(len(COUNTS), 8, 12).to(torch.bfloat16)  # 12 bf16 = 24 bytes a row
    x = torch.randn(sum(COUNTS), 8, dtype=torch.bfloat16)
    assert torch.equal(m(x, torch.tensor(COUNTS)), per_expert(m, x, COUNTS))


def test_experts_are_swiglu_mlps_and_init_per_expert() -> None:
    torch.manual_seed(0)
    m = GroupedExperts(len(COUNTS), 8, 12)
    x = torch.randn(sum(COUNTS), 8)
    torch.testing.assert_close(m(x, torch.tensor(COUNTS)), per_expert(m, x, COUNTS))
    # nn.Linear's default bound, 1/sqrt(fan_in) of one expert (not of the stack)
    assert m.w1.abs().max() <= 8**-0.5 and m.w1.abs().max() > 0.9 * 8**-0.5
    assert m.w2.abs().max() <= 12**-0.5 and m.w2.abs().max() > 0.9 * 12**-0.5
