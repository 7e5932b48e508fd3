"""Tests of the Llama transformer: shapes, causality, GQA and RoPE against references, the
sharding-invariant init (1 process, meta + to_empty, 2-process FSDP2), parameter and FLOP
counts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from plugtrain.model.llama.transformer import (
    FLAVORS,
    ModelArgs,
    Transformer,
    apply_rotary_emb,
    precompute_freqs_cis,
    rotate_pairs,
)
from plugtrain.testing import free_port

TINY = FLAVORS["tiny"]


def make_model(args: ModelArgs = TINY, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


def random_tokens(args: ModelArgs, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def test_forward_shape_and_dtype() -> None:
    model = make_model()
    logits = model(random_tokens(TINY, batch=3, seq=17))
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_initial_loss_is_near_uniform() -> None:
    """The output projection's std dim**-0.5 gives logits of about unit scale: the initial loss
    is close to log(vocab), not blown up."""
    model = make_model(dataclasses.replace(TINY, vocab_size=1024))
    tokens = random_tokens(model.args, batch=4, seq=32)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(1024)) < 1.0


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    model = make_model()
    tokens = random_tokens(TINY, batch=2, seq=24)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=0)
    # The change does reach position 10 and later ones (so the check above can fail).
    assert not torch.allclose(after[:, 10:], before[:, 10:])


def reference_attention(attention: torch.nn.Module, x: torch.Tensor, freqs_cis: torch.Tensor):
    """Multi-head attention written out: kv heads repeated per group, explicit causal mask."""
    batch, seq, _ = x.shape
    n_heads, n_kv, head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    q = apply_rotary_emb(attention.wq(x).view(batch, seq, n_heads, head_dim), freqs_cis)
    k = apply_rotary_emb(attention.wk(x).view(batch, seq, n_kv, head_dim), freqs_cis)
    v = attention.wv(x).view(batch, seq, n_kv, head_dim)
    k = k.repeat_interleave(n_heads // n_kv, dim=2)  # query head h uses kv head h // group
    v = v.repeat_interleave(n_heads // n_kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, -1)
    return attention.wo(out)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_matches_reference(n_kv_heads: int) -> None:
    args = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    model = make_model(args)
    attention = model.layers["0"].attention
    assert attention.wk.weight.shape == (n_kv_heads * args.head_dim, args.dim)
    x = torch.randn(2, 12, args.dim, generator=torch.Generator().manual_seed(1))
    freqs_cis = model.freqs_cis[:12]
    torch.testing.assert_close(
        attention(x, freqs_cis), reference_attention(attention, x, freqs_cis)
    )


def test_rope_scores_depend_only_on_relative_position() -> None:
    head_dim = 16
    freqs_cis = precompute_freqs_cis(head_dim, max_seq_len=64, theta=10000.0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)

    def score(m: int, n: int) -> torch.Tensor:
        """<rope(q, position m), rope(k, position n)>"""
        seq = max(m, n) + 1
        qs = apply_rotary_emb(q.expand(1, seq, 1, head_dim), freqs_cis[:seq])[0, m, 0]
        ks = apply_rotary_emb(k.expand(1, seq, 1, head_dim), freqs_cis[:seq])[0, n, 0]
        return qs @ ks

    torch.testing.assert_close(score(5, 2), score(40, 37))
    # Meta's convention: channels (0, 1) form a pair rotated counter-clockwise by pos * 1 rad.
    x = torch.zeros(1, 2, 1, head_dim)
    x[..., 0] = 1.0
    rotated = apply_rotary_emb(x, freqs_cis[:2])[0, :, 0]
    torch.testing.assert_close(rotated[1, :2], torch.tensor([math.cos(1.0), math.sin(1.0)]))
    torch.testing.assert_close(rotated[0], x[0, 0, 0])
    torch.testing.assert_close(score(0, 0), q @ k)  # position 0 is not rotated
    assert not torch.allclose(score(5, 2), score(5, 4))


def complex_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """RoPE as one complex multiplication per channel pair: the reference (Meta's formula)."""
    x_c = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_c * freqs_cis[None, :, None, :]).flatten(-2).type_as(x)


@pytest.mark.parametrize(
    ("start", "seq", "dtype"),
    [
        (0, 128, torch.float32),
        (37, 1, torch.float32),
        (5, 7, torch.float32),
        (0, 16, torch.bfloat16),
    ],
    ids=["train", "decode-step", "prefill-after-cache", "bf16"],
)
def test_rope_in_real_arithmetic_is_bitwise_the_complex_product(start, seq, dtype) -> None:
    """rotate_pairs (what torch.compile traces) and apply_rotary_emb, eager and compiled, give
    the complex formula's values and gradients bit for bit, at any position (the KV cache's)."""
    freqs_cis = precompute_freqs_cis(32, max_seq_len=256, theta=500000.0)[start : start + seq]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, seq, 4, 32, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(3, seq, 4, 32, generator=gen).to(dtype)
    expected = complex_rope(x, freqs_cis)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    compiled = torch.compile(apply_rotary_emb, backend="eager", fullgraph=True)
    for rope in (rotate_pairs, apply_rotary_emb, compiled):
        out = rope(x, freqs_cis)
        (out_grad,) = torch.autograd.grad(out, x, grad)
        assert out.dtype == dtype
        assert torch.equal(out, expected), rope
        assert torch.equal(out_grad, expected_grad), rope


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name


def test_init_weights_is_deterministic_per_seed() -> None:
    a, b, c = make_model(seed=3), make_model(seed=3), make_model(seed=4)
    assert_same_parameters(a, b)
    for (name, pa), pc in zip(a.named_parameters(), c.parameters(), strict=True):
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)) and torch.equal(pc, pa), name
        else:
            assert not torch.equal(pa, pc), name


def test_init_weights_distributions() -> None:
    args = dataclasses.replace(TINY, dim=64, vocab_size=512, n_layers=3)
    model = make_model(args)

    def check(param: torch.Tensor, std: float, truncated: bool) -> None:
        # A normal truncated at +-3 std has a standard deviation of 0.9866 std.
        expected_std = 0.9866 * std if truncated else std
        assert abs(param.mean().item()) < 0.1 * std
        assert abs(param.std().item() - expected_std) < 0.05 * std
        if truncated:
            assert param.abs().max().item() <= 3 * std

    check(model.tok_embeddings.weight, 1.0, truncated=False)
    assert model.tok_embeddings.weight.abs().max().item() > 3  # a plain normal, not truncated
    check(model.output.weight, args.dim**-0.5, truncated=True)
    for layer_id, layer in enumerate(model.layers.values()):
        for w in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
            check(w.weight, 0.02, truncated=True)
        for w in (layer.feed_forward.w1, layer.feed_forward.w3):
            check(w.weight, 0.02, truncated=True)
        out_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        check(layer.attention.wo.weight, out_std, truncated=True)
        check(layer.feed_forward.w2.weight, out_std, truncated=True)


def test_meta_to_empty_init_equals_cpu_init() -> None:
    reference = make_model(seed=11)
    with torch.device("meta"):
        model = Transformer(TINY)
    model.to_empty(device="cpu")
    model.init_weights(11)
    assert_same_parameters(model, reference)
    assert torch.equal(model.freqs_cis, reference.freqs_cis)
    tokens = random_tokens(TINY, batch=2, seq=16)
    assert torch.equal(model(tokens), reference(tokens))


def test_init_weights_on_meta_parameters_raises() -> None:
    with torch.device("meta"):
        model = Transformer(TINY)
    with pytest.raises(RuntimeError, match="to_empty"):
        model.init_weights(0)


def test_sequence_longer_than_max_seq_len_raises() -> None:
    model = make_model()
    too_long = TINY.max_seq_len + 1
    with pytest.raises(
        ValueError, match=rf"sequence length {too_long} .*max_seq_len {TINY.max_seq_len}"
    ):
        model(random_tokens(TINY, batch=1, seq=too_long))
    assert model(random_tokens(TINY, batch=1, seq=TINY.max_seq_len)).shape[1] == TINY.max_seq_len


def test_rope_buffer_cast_to_real_dtype_raises() -> None:
    model = make_model()
    with pytest.warns(UserWarning):  # Module.to(dtype) warns when it discards imaginary parts
        model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"freqs_cis was cast to torch\.bfloat16"):
        model(random_tokens(TINY, batch=1, seq=4))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 30}, "dim=30 is not divisible by n_heads=4"),
        ({"n_kv_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"dim": 12, "n_heads": 4}, "head_dim = dim // n_heads = 3 is odd"),
        ({"n_layers": 0}, "n_layers must be >= 1"),
        ({"ffn_dim_multiplier": 0.0}, "ffn_dim_multiplier must be > 0"),
    ],
)
def test_invalid_model_args_raise(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **changes)


@pytest.mark.parametrize(
    "args",
    [TINY, dataclasses.replace(TINY, ffn_dim_multiplier=1.3, n_kv_heads=1, vocab_size=100)],
    ids=["tiny", "multiplier-mqa"],
)
def test_num_params_matches_the_built_model(args: ModelArgs) -> None:
    model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    assert args.num_params() == total
    assert args.num_params(exclude_embedding=True) == total - model.tok_embeddings.weight.numel()


def test_large_flavours_match_published_llama_shapes() -> None:
    # Hidden sizes from the released configs (intermediate_size).
    assert FLAVORS["405B"].ffn_hidden_dim == 53248
    assert FLAVORS["70B"].ffn_hidden_dim == 28672
    assert FLAVORS["8B"].ffn_hidden_dim == 14336
    assert FLAVORS["3B"].ffn_hidden_dim == 8192
    assert FLAVORS["1B"].ffn_hidden_dim == 8192
    # Published parameter counts: Llama 3 8B (untied); Llama 3.2 1B and 3B tie the output
    # projection to the embedding, which plugtrain does not, so add one vocab x dim matrix.
    assert FLAVORS["8B"].num_params() == 8_030_261_248
    assert FLAVORS["70B"].num_params() == 70_553_706_496
    assert FLAVORS["405B"].num_params() == 405_853_388_800
    for name, published in (("1B", 1_235_814_400), ("3B", 3_212_749_824)):
        args = FLAVORS[name]
        assert args.num_params() == published + args.vocab_size * args.dim, name


def test_flops_per_token_matches_counted_matmul_flops() -> None:
    """6N + 12*L*H*Dh*S is the matmul FLOPs of forward+backward, counted by torch's
    FlopCounterMode (the math SDPA backend makes the attention matmuls visible to it), up to
    the norm scales: the usual estimate counts them in N although they feed no matmul."""
    model = make_model()
    batch, seq = 2, 32
    tokens = random_tokens(TINY, batch, seq)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    norm_params = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert norm_params == (2 * TINY.n_layers + 1) * TINY.dim
    expected = (TINY.flops_per_token(seq) - 6 * norm_params) * batch * seq
    assert counter.get_total_flops() == expected
    # The step's GEMMs, as the roofline times them: the projections' are torch's mm, the
    # attention's its bmm (with the math backend).
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    gemms = TINY.gemms(batch, seq)
    attention = sum(g.flops for g in gemms if g.name.startswith("attention."))
    assert by_op == {"aten.mm": expected - attention, "aten.bmm": attention}
    assert sum(g.flops for g in gemms) == expected


# ---------------------------------------------------------------------------------------------
# 2-process FSDP2 init


def fsdp_init_worker(rank: int, world_size: int, port: int, args: ModelArgs, seed: int) -> None:
    """Build on meta, shard every block and the root, to_empty, init_weights; then every full
    parameter and the logits must equal a plain 1-process model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with torch.device("meta"):
            model = Transformer(args)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_weights(seed)

        reference = make_model(args, seed)
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
            assert torch.equal(param.full_tensor(), ref_params[name]), f"rank {rank}: {name}"
        tokens = random_tokens(args, batch=2, seq=16)
        torch.testing.assert_close(model(tokens), reference(tokens))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_sharded_init_equals_single_process_init() -> None:
    # vocab 257 rows split unevenly over 2 ranks (129 + 128): FSDP2's padded shards.
    args = dataclasses.replace(TINY, vocab_size=257)
    world_size = 2
    mp.spawn(fsdp_init_worker, args=(world_size, free_port(), args, 5), nprocs=world_size)
