"""The moe family on the CPU: the debug MoE against a dense model of its active parameters, and
the routed experts' grouped GEMM against the loop over experts.

1. **MoE vs dense**: a training forward and backward (fp32, batch 8 x 128 tokens) of
   ``debug_moe`` (8 experts, top-2, expert hidden 64) and of a Llama of the same width, depth
   and attention whose SwiGLU is as wide as the two experts a token uses (hidden 128): the
   same active parameters but the router's gate. The ratio is the dense step's time over the
   MoE's (its tokens per second over the dense model's), the two taking turns.
2. **grouped GEMM vs loop**: ``GroupedExperts`` forward and backward at a layer's shape
   (8 experts, 2048 token copies spread evenly, dim 256, hidden 512), fp32 and bf16, once
   through ``F.grouped_mm``, once through the loop over experts it falls back to; outputs and
   gradients must be bitwise equal.

    python bench/moe.py          # about a minute on 2 cores (60 rounds)
    python bench/moe.py --quick  # a few rounds: checks that it runs

The GPU part (bf16 at a Qwen3-30B-A3B layer's shape) is ``bench/gpu_check.py``'s ``moe``.
"""

from __future__ import annotations

import time

import benchlib
import torch

from plugtrain.model import ModelArgs, Transformer, cross_entropy
from plugtrain.model.moe import FLAVORS, GroupedExperts, MoETransformer, experts

NAME = "moe"


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """``debug_moe`` and the dense Llama of its active parameters, initialised."""
    moe_args = FLAVORS["debug_moe"]
    dense_args = ModelArgs(
        dim=moe_args.dim,
        n_layers=moe_args.n_layers,
        n_heads=moe_args.n_heads,
        n_kv_heads=moe_args.n_kv_heads,
        vocab_size=moe_args.vocab_size,
        ffn_dim=moe_args.top_k * moe_args.moe_ffn_dim,
        max_seq_len=moe_args.max_seq_len,
    )
    moe, dense = MoETransformer(moe_args), Transformer(dense_args)
    moe.init_weights(0)
    dense.init_weights(0)
    return moe, dense


def train_pass(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def moe_vs_dense(n_rounds: int) -> dict:
    moe, dense = models()
    tokens = torch.randint(
        0, moe.args.vocab_size, (8, 129), generator=torch.Generator().manual_seed(0)
    )
    for model in (moe, dense):
        train_pass(model, tokens)  # warm-up
    seconds: list[list[float]] = [[], []]
    for i in benchlib.rounds(n_rounds, 2):
        seconds[i].append(timed(train_pass, (moe, dense)[i], tokens))
    active = moe.args.num_params(exclude_embedding=True, active=True)
    return {
        "tokens_per_step": 8 * 128,
        "moe_active_params": active,
        "moe_total_params": moe.args.num_params(exclude_embedding=True),
        "dense_params": dense.args.num_params(exclude_embedding=True),
        # dense time / MoE time: the MoE's tokens per second over the dense model's
        "moe_tokens_per_s_vs_dense": benchlib.paired_ratio(seconds[1], seconds[0]),
    }


def experts_pass(module: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> list:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x, counts)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad, *(p.grad for p in module.parameters())]


CPU_LAYER = {"experts": 8, "tokens": 2048, "dim": 256, "hidden": 512}
"""The CPU part's layer: 2048 token copies over 8 experts."""
QWEN3_30B_A3B_LAYER = {"experts": 128, "tokens": 4096 * 8, "dim": 2048, "hidden": 768}
"""A Qwen3-30B-A3B layer's experts at 4096 tokens routed top-8 (``bench/gpu_check.py``)."""


def grouped_vs_loop(
    n_rounds: int, dtype: torch.dtype, layer: dict[str, int], device: str = "cpu"
) -> dict:
    """``GroupedExperts`` forward and backward through ``F.grouped_mm`` and through the loop,
    taking turns, the token copies spread evenly over the experts of ``layer``."""
    torch.manual_seed(0)
    n_experts, tokens = layer["experts"], layer["tokens"]
    module = GroupedExperts(n_experts, layer["dim"], layer["hidden"]).to(device, dtype)
    x = torch.randn(tokens, layer["dim"], dtype=dtype, device=device)
    counts = torch.full((n_experts,), tokens // n_experts, device=device)
    grouped = experts_pass(module, x, counts)
    experts.HAS_GROUPED_MM = False
    looped = experts_pass(module, x, counts)
    experts.HAS_GROUPED_MM = True
    bitwise = all(torch.equal(a, b) for a, b in zip(grouped, looped, strict=True))
    del grouped, looped
    seconds: list[list[float]] = [[], []]
    for i in benchlib.rounds(n_rounds, 2):
        experts.HAS_GROUPED_MM = i == 0
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        experts_pass(module, x, counts)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds[i].append(time.perf_counter() - start)
    experts.HAS_GROUPED_MM = True
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "shape": layer,
        "bitwise_equal": bitwise,
        "grouped_vs_loop_time": benchlib.paired_ratio(seconds[0], seconds[1]),
    }


def ci(ratio: dict) -> str:
    low, high = ratio["ratio_ci95"]
    return f"{ratio['ratio']['median']:.3f} [{low:.3f}, {high:.3f}]"


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0])
    n_rounds = 2 if args.quick else 60
    results = {
        "moe_vs_dense": moe_vs_dense(n_rounds),
        "grouped_vs_loop": [
            grouped_vs_loop(n_rounds, d, CPU_LAYER) for d in (torch.float32, torch.bfloat16)
        ],
    }
    versus = results["moe_vs_dense"]
    print(
        benchlib.table(
            ["model", "params (no embedding)", "active", "MoE tokens/s / dense [95% CI]"],
            [
                [
                    "debug_moe",
                    versus["moe_total_params"],
                    versus["moe_active_params"],
                    ci(versus["moe_tokens_per_s_vs_dense"]),
                ],
                ["dense", versus["dense_params"], versus["dense_params"], 1],
            ],
        )
    )
    print()
    print(
        benchlib.table(
            ["dtype", "grouped / loop time [95% CI]", "bitwise equal"],
            [
                [g["dtype"], ci(g["grouped_vs_loop_time"]), g["bitwise_equal"]]
                for g in results["grouped_vs_loop"]
            ],
        )
    )
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
