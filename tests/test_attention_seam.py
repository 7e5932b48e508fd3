"""The attention seam (model/attention.py): its SDPA variant computes exactly what the model's
attention computed before the seam existed, with and without a KV cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from plugtrain.model import FLAVORS, KVCache, Transformer
from plugtrain.model.attention import SDPA, attention_variant
from plugtrain.model.llama.transformer import apply_rotary_emb

TINY = FLAVORS["tiny"]  # 4 query heads, 2 key/value heads: grouped-query attention


def model() -> Transformer:
    m = Transformer(TINY)
    m.init_weights(seed=0)
    return m


def attention_before_the_seam(attention, x, freqs_cis, cache=None):
    """The model's attention as it was written before the seam (the reference), SDPA's
    flags included."""
    batch, seq, _ = x.shape
    n_heads, n_kv, head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    q = apply_rotary_emb(attention.wq(x).view(batch, seq, n_heads, head_dim), freqs_cis)
    k = apply_rotary_emb(attention.wk(x).view(batch, seq, n_kv, head_dim), freqs_cis)
    v = attention.wv(x).view(batch, seq, n_kv, head_dim)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask, is_causal = None, True
    if cache is not None:
        start = cache.length
        k, v = cache.store(attention.layer_id, k, v)
        is_causal = seq > 1 and start == 0
        if seq > 1 and start > 0:
            mask = torch.ones(seq, start + seq, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=n_kv != n_heads
    )
    return attention.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def test_training_attention_is_the_previous_computation_bitwise() -> None:
    m = model()
    x = torch.randn(2, 24, TINY.dim, generator=torch.Generator().manual_seed(1))
    freqs_cis = m.freqs_cis[:24]
    for layer in m.layers.values():
        got = layer.attention(x, freqs_cis)
        torch.testing.assert_close(
            got, attention_before_the_seam(layer.attention, x, freqs_cis), rtol=0, atol=0
        )


@torch.no_grad()
def test_cached_attention_is_the_previous_computation_bitwise() -> None:
    """A 1-token prompt, a multi-token chunk after it, then one-token steps: each of the
    mask cases (none at a single query, SDPA's is_causal, the offset mask)."""
    m = model()
    attention, variant = m.layers["0"].attention, SDPA()
    ours, theirs = KVCache(TINY, max_batch=2), KVCache(TINY, max_batch=2)
    gen = torch.Generator().manual_seed(2)
    for seq in (1, 5, 1, 1, 3):
        start = ours.length
        tokens = torch.zeros(2, seq, dtype=torch.long)
        x = torch.randn(2, seq, TINY.dim, generator=gen)
        freqs_cis = m.freqs_cis[start : start + seq]
        got = attention(x, freqs_cis, cache=ours, mask=variant.mask(tokens, start))
        want = attention_before_the_seam(attention, x, freqs_cis, cache=theirs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        ours.length += seq
        theirs.length += seq


def test_sdpa_mask_is_built_only_for_a_chunk_after_cached_positions() -> None:
    variant = SDPA()
    assert variant.mask(torch.zeros(2, 8, dtype=torch.long), start=0) is None
    assert variant.mask(torch.zeros(2, 1, dtype=torch.long), start=5) is None
    mask = variant.mask(torch.zeros(2, 3, dtype=torch.long), start=2)
    assert mask is not None
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


def test_an_unknown_attention_variant_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"ModelArgs\.attention='flex' .* one of: sdpa, document$"):
        attention_variant("flex")
    with pytest.raises(ValueError, match=r"ModelArgs\.attention='nope'"):
        Transformer(dataclasses.replace(TINY, attention="nope"))
