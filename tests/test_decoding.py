"""Tests of the KV cache (model.transformer.KVCache) and the decoding loop (model.decoding):
cached logits and generations against the cache-free forward, sampling options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plugtrain.errors import UserError
from plugtrain.model.decoding import generate, next_token
from plugtrain.model.llama.transformer import FLAVORS, KVCache, Transformer

# A vocabulary smaller than tiny's makes greedy generations of a random model vary more.
ARGS = dataclasses.replace(FLAVORS["tiny"], vocab_size=61, max_seq_len=48)


def make_model(seed: int = 0) -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed)
    return model


def tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARGS.vocab_size, (batch, seq), generator=generator)


@pytest.mark.parametrize("chunks", [[7, 1, 1, 1, 1, 1, 1], [5, 3, 1, 4, 1], [1, 1, 1, 1]])
def test_cached_logits_equal_the_full_forward_at_every_position(chunks: list[int]) -> None:
    """A prefill, then chunks of one or more tokens: each chunk's logits through the cache are
    the full forward's at the same positions (several-token chunks after the first check the
    offset causal mask; one-token chunks the decode step)."""
    model = make_model()
    sequence = tokens(batch=2, seq=sum(chunks))
    with torch.no_grad():
        full = model(sequence)
        cache = KVCache(ARGS, max_batch=2, max_seq_len=sum(chunks))
        cached = torch.cat([model(chunk, cache) for chunk in sequence.split(chunks, dim=1)], 1)
    assert cache.length == sum(chunks)
    torch.testing.assert_close(cached, full, rtol=0, atol=2e-6)
    # Positions matter: the last chunk's logits from a fresh cache (positions 0..) differ.
    with torch.no_grad():
        fresh = model(sequence[:, -chunks[-1] :], KVCache(ARGS, max_batch=2))
    assert not torch.allclose(fresh, full[:, -chunks[-1] :], atol=1e-3)


def test_the_cache_refuses_more_tokens_than_it_holds() -> None:
    model = make_model()
    cache = KVCache(ARGS, max_batch=1, max_seq_len=4)
    with torch.no_grad():
        model(tokens(1, 3), cache)
        with pytest.raises(ValueError, match=r"KVCache holds 1 x 4 positions; .* 1 x 2 tokens"):
            model(tokens(1, 2), cache)


def reference_greedy(model: Transformer, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding written out: the argmax of the full forward's last logits, n times."""
    sequence = prompt
    with torch.no_grad():
        for _ in range(n):
            token = model(sequence)[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, token], dim=1)
    return sequence[:, prompt.shape[1] :]


def test_greedy_generation_with_the_cache_equals_the_cache_free_loop() -> None:
    model = make_model()
    prompt = tokens(batch=3, seq=6)
    expected = reference_greedy(model, prompt, 30)
    assert torch.equal(generate(model, prompt, 30), expected)
    assert torch.equal(generate(model, prompt, 30, use_cache=False), expected)
    assert len(set(expected[0].tolist())) > 3  # a random model that does not repeat one token


def test_generation_stops_when_every_row_wrote_eos() -> None:
    model = make_model()
    prompt = tokens(batch=2, seq=6)
    free = generate(model, prompt, 20)
    eos = int(free[0, 4])  # row 0 writes it at step 5: treat it as end of text
    out = generate(model, prompt, 20, eos_id=eos)
    first_eos = [row.tolist().index(eos) if eos in row.tolist() else None for row in free]
    assert out.shape[1] == max(i + 1 if i is not None else 20 for i in first_eos)
    for row, stop, free_row in zip(out, first_eos, free, strict=True):
        assert torch.equal(row[: stop + 1], free_row[: stop + 1])
        assert (row[stop:] == eos).all()  # padded with eos after its end


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy() -> None:
    model = make_model()
    prompt = tokens(batch=2, seq=5)

    def sample(seed: int, **options: float) -> torch.Tensor:
        return generate(
            model, prompt, 25, temperature=1.0, generator=torch.Generator().manual_seed(seed),
            **options,
        )  # fmt: skip

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))
    greedy = generate(model, prompt, 25)
    assert torch.equal(sample(3, top_k=1), greedy)
    assert torch.equal(sample(4, top_p=1e-6), greedy)


def test_top_k_and_top_p_sample_only_from_the_kept_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).expand(4000, -1)
    generator = torch.Generator().manual_seed(0)
    top2 = next_token(logits, temperature=1.0, top_k=2, generator=generator)
    assert set(top2.tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: top_p 0.8 keeps the first two
    nucleus = next_token(logits, temperature=1.0, top_p=0.8, generator=generator)
    assert set(nucleus.tolist()) == {0, 1}
    share = (nucleus == 0).float().mean().item()
    assert abs(share - probs[0] / probs[:2].sum()) < 0.03
    everything = next_token(logits, temperature=1.0, generator=generator)
    assert set(everything.tolist()) == {0, 1, 2, 3, 4}


def test_a_prompt_too_long_for_the_model_is_refused() -> None:
    with pytest.raises(UserError, match=r"40 tokens plus 10 new tokens .* max_seq_len 48"):
        generate(make_model(), tokens(1, 40), 10)


def test_generation_runs_compiled_blocks_eagerly() -> None:
    """Blocks compiled as the compile plugin compiles them (static shapes, fullgraph) would
    recompile at each cache length, and fail at dynamo's recompile limit: decoding runs them
    eagerly."""
    model, reference = make_model(), make_model()
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend="eager", fullgraph=True, dynamic=False)
    model(tokens(batch=2, seq=16)).sum().backward()  # a training step's forward compiles them
    prompt = tokens(batch=1, seq=4)
    assert torch.equal(generate(model, prompt, 20), generate(reference, prompt, 20))


def test_the_cache_does_one_forwards_arithmetic_and_the_cache_free_loop_far_more() -> None:
    """With the cache each token's matmuls run once, so generating n tokens counts the FLOPs of
    one forward of the prompt and n - 1 tokens (the last one is never fed back); without it
    every step recomputes the whole prefix. bench/generate.py times the three."""
    from torch.utils.flop_counter import FlopCounterMode

    model = make_model()
    prompt, n = tokens(batch=1, seq=8), 16
    whole = torch.cat([prompt, torch.zeros(1, n - 1, dtype=torch.long)], dim=1)
    flops = {}
    for name, run in [
        ("cached", lambda: generate(model, prompt, n)),
        ("uncached", lambda: generate(model, prompt, n, use_cache=False)),
        ("one_forward", lambda: model(whole)),
    ]:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run()
        flops[name] = counter.get_total_flops()
    assert flops["cached"] == pytest.approx(flops["one_forward"], rel=0.02)
    assert flops["uncached"] > 5 * flops["cached"]
