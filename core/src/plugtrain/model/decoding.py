"""Text generation with the transformer: greedy or sampled decoding over a KV cache.

The one decoding loop of plugtrain: ``plugtrain generate`` calls it on a model loaded from a
checkpoint, and plugins reach it through :mod:`plugtrain.plugin` (the ``samples`` plugin
calls it on the model being trained, FSDP2-sharded, tensor-parallel or neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from plugtrain.errors import UserError
from plugtrain.model.tensor_parallel import tensor_parallel_degree, whole_logits

__all__ = ["TextTokenizer", "complete", "generate", "next_token"]


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[B, vocab]``: ``[B]`` int64.

    ``temperature`` 0 is greedy (the argmax). Otherwise the logits are divided by it, cut to
    the ``top_k`` most likely tokens (0: all), then to the smallest set whose probability
    reaches ``top_p`` (1: all), and one token is drawn from ``generator``.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p: the first always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    tokens: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """The tokens ``model`` writes after the prompts ``tokens`` ``[B, S]``: ``[B, n]`` int64.

    Decodes up to ``max_new_tokens`` tokens with :func:`next_token` (greedy by default); stops
    early once every row has written ``eos_id``, and pads a row that wrote it before the others
    with it. ``use_cache`` False recomputes the whole sequence at each step (the reference the
    KV cache is checked against). ``model`` is a family's model (its ``kv_cache`` makes the
    cache; Llama's :class:`~plugtrain.model.llama.transformer.Transformer`), FSDP2-sharded,
    tensor-parallel (:func:`~plugtrain.model.tensor_parallel.whole_logits`) or neither: sharded,
    every rank must call this with the same arguments (and generator state), so that all join
    the same forwards and write the same tokens.
    """
    batch, prompt_len = tokens.shape
    max_seq_len = model.args.max_seq_len
    # Under tensor parallelism each forward is padded by up to tp - 1 positions (whole_logits).
    padding = tensor_parallel_degree(model) - 1
    limit = max_seq_len - padding
    if prompt_len < 1 or prompt_len + max_new_tokens > limit:
        padded = f" (less {padding} for tensor parallelism's padding)" if padding else ""
        raise UserError(
            f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens does not fit the "
            f"model's max_seq_len {max_seq_len}{padded}: give a prompt of 1 to {limit - 1} "
            "tokens and fewer new tokens"
        )
    length = prompt_len + max_new_tokens + padding
    cache = model.kv_cache(batch, length) if use_cache else None
    sequence, step_input = tokens, tokens
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    new: list[torch.Tensor] = []
    # Blocks compiled for training (the compile plugin) run eagerly here: each cache length
    # and sequence length would be a new graph, a recompile every step.
    with torch.compiler.set_stance("force_eager"):
        for _ in range(max_new_tokens):
            logits = whole_logits(model, sequence if cache is None else step_input, cache)
            token = next_token(
                logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p,
                generator=generator,
            )  # fmt: skip
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done |= token == eos_id
            new.append(token)
            step_input = token[:, None]
            sequence = torch.cat([sequence, step_input], dim=1)
            if eos_id is not None and bool(done.all()):
                break
    return torch.stack(new, dim=1) if new else tokens.new_empty(batch, 0)


class TextTokenizer(Protocol):
    """What :func:`complete` needs of a tokenizer (:class:`plugtrain.data.tokenizer.Tokenizer`)."""

    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


def complete(
    model: nn.Module,
    tokenizer: TextTokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    prompt_ids: list[int] | None = None,
    stop_id: int | None = None,
) -> str:
    """The text ``model`` writes after ``prompt``, up to its end-of-text token (excluded).

    ``prompt_ids``, when given, are the prompt already laid out (a chat template's), and
    ``stop_id`` replaces the end-of-text token (a template's end of turn).

    The prompt is laid out as training documents are, after ``bos_id`` when the tokenizer has
    one. Sampling (``temperature`` > 0) draws from a generator seeded with ``seed`` on the
    model's device (None: the global one); see :func:`generate` for the rest.
    """
    device = next(model.parameters()).device
    ids = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
    if prompt_ids is not None:
        ids = prompt_ids
    stop = tokenizer.eos_id if stop_id is None else stop_id
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    new = generate(
        model,
        torch.tensor([ids], device=device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        eos_id=stop,
    )[0].tolist()
    if stop in new:
        new = new[: new.index(stop)]
    # Decoded with the prompt, so that a character whose bytes straddle the boundary, or a
    # leading space a decoder strips at the start, come out as they would in the whole text.
    head, whole = tokenizer.decode(ids), tokenizer.decode(ids + new)
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new)
