"""Document masking (``model.attention = "document"``) and per-document positions: a packed row
gives each document the numbers it gets alone (transformers' judge is in test_hf.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from plugtrain.data import MicroBatch, iter_eval_batches
from plugtrain.model import FLAVORS, KVCache, Transformer, cross_entropy
from plugtrain.model.attention import DocumentMasking, document_block_mask
from plugtrain.testing import (
    SAMPLE,
    document_spans,
    load_jsonl_texts,
    make_trainer,
    packed_documents,
)

TINY = dataclasses.replace(FLAVORS["tiny"], attention="document")  # grouped-query attention
LENGTHS = [(5, 11, 8), (13, 2, 9)]
"""The documents of each packed row (24 tokens): short and long ones, first and last."""


def model(args=TINY) -> Transformer:
    m = Transformer(args)
    m.init_weights(seed=0)
    return m


@torch.no_grad()
def test_each_document_of_a_packed_row_gets_the_logits_and_loss_it_gets_alone():
    """And the negative control: without masking, every document but the rows' first differ."""
    m, batch = model(), packed_documents(LENGTHS, TINY.vocab_size)
    masked = m(batch.inputs, **batch.model_inputs())
    causal = m(batch.inputs)
    for row, documents in enumerate(batch.documents):
        for i, span in enumerate(document_spans(documents)):
            alone = m(batch.inputs[row : row + 1, span])[0]
            targets = batch.targets[row, span][None]
            assert (masked[row, span] - alone).abs().max() < 1e-5, (row, i)
            loss = cross_entropy(masked[row, span][None], targets)
            assert abs(loss - cross_entropy(alone[None], targets)) < 1e-5
            error = (causal[row, span] - alone).abs().max()
            assert error < 1e-5 if i == 0 else error > 1e-2, (row, i, error)


@pytest.mark.slow  # create_block_mask's first eager call takes seconds (vmap, tracing)
def test_flex_attention_under_the_block_mask_gives_the_boolean_masks_numbers():
    """The CUDA kernel's mask against the CPU's: flex attention (eager and forward only, as
    it has no CPU backward) under ``document_block_mask`` equals SDPA under the boolean mask."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 24, 16, generator=gen)
    k, v = (torch.randn(2, 2, 24, 16, generator=gen) for _ in range(2))
    variant, batch = DocumentMasking(), packed_documents(LENGTHS, TINY.vocab_size)
    block_mask = document_block_mask(batch.documents, compiled=False)
    with pytest.warns(UserWarning, match="without torch.compile"):  # eager: scores in full
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    sdpa = variant(q, k, v, variant.mask(batch.inputs, 0, batch.documents))
    assert (flex - sdpa).abs().max() < 1e-5


@torch.no_grad()
def test_without_documents_a_row_is_one_document_as_in_decoding():
    """Generation and scoring hand no documents: the variant is then SDPA's causal attention,
    bitwise, with and without a KV cache; documents with a cache are refused."""
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    masked, causal = model(), model(dataclasses.replace(TINY, attention="sdpa"))
    assert torch.equal(masked(tokens), causal(tokens))
    caches = [KVCache(TINY, max_batch=2) for _ in range(2)]
    for chunk in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:]):
        assert torch.equal(masked(chunk, caches[0]), causal(chunk, caches[1]))
    with pytest.raises(ValueError, match="document masking takes no KV cache"):
        masked(tokens[:, :1], caches[0], documents=torch.zeros(2, 1, dtype=torch.int32))


@pytest.fixture(scope="module")
def paragraphs(tmp_path_factory) -> str:
    """A JSONL file of the sample's first 200 paragraphs, one document each: short documents,
    so that every packed row holds several."""
    texts = [p for t in load_jsonl_texts(SAMPLE / "validation.jsonl") for p in t.split("\n\n")]
    path = tmp_path_factory.mktemp("paragraphs") / "paragraphs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:200]))
    return str(path)


@torch.no_grad()
def test_training_and_validation_losses_are_those_of_each_document_alone(tmp_path, paragraphs):
    """The trainer hands the model each batch's documents and positions: a training step's
    loss and the validation loss are those of the documents one by one."""
    trainer = make_trainer(
        tmp_path,
        *("--model.attention", "document", "--training.seq_len", "64"),
        *("--data.train_path", paragraphs, "--data.validation_path", paragraphs),
        *("--validation.interval", "1", "--validation.steps", "2"),
    )
    assert trainer.config.data.reset_positions is True  # "auto" with document masking

    def alone(batch: MicroBatch) -> torch.Tensor:
        """The loss of each document of ``batch`` on its own, summed."""
        total = torch.zeros((), dtype=torch.float64)
        assert batch.documents[:, -1].sum() > len(batch.documents)  # rows of several documents
        for row, documents in enumerate(batch.documents):
            for span in document_spans(documents):
                logits = trainer.model(batch.inputs[row, span][None])
                total += cross_entropy(logits, batch.targets[row, span][None]) * logits.shape[1]
        return total

    val_batches = iter_eval_batches(
        trainer.val_data, batch_size=4, rank=0, world_size=1, max_batches=2
    )
    expected = sum(alone(b) for b in val_batches) / (2 * 4 * 64)
    assert trainer.validate()["validation_loss"] == pytest.approx(float(expected), abs=1e-5)
    (microbatch,) = batch = trainer.batches.next_batch()
    expected = alone(microbatch) / microbatch.targets.numel()
    with torch.enable_grad():
        loss, _ = trainer.train_step(batch)
    trainer.close()
    assert abs(loss - expected) < 1e-5


def test_activation_checkpointing_recomputes_the_masked_step_bitwise(tmp_path, paragraphs):
    """The mask and the per-token rotations reach checkpointed blocks: same loss, same
    gradients as without checkpointing."""
    args = ("--model.attention", "document", "--data.train_path", paragraphs)
    results = []
    for i, extra in enumerate([(), ("--plugins.enabled", "activation_checkpointing")]):
        trainer = make_trainer(tmp_path / str(i), *args, *extra)
        if extra:
            assert trainer.host.get("activation_checkpointing").checkpointed_blocks
        batch = trainer.batches.next_batch()
        loss = trainer.loss.fn(trainer.model(batch[0].inputs, **batch[0].model_inputs()),
                               batch[0].targets)  # fmt: skip
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]))
        trainer.close()
    (loss, grads), (ac_loss, ac_grads) = results
    assert torch.equal(loss, ac_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ac_grads, strict=True))
