"""Document masking's two kernels agree on the device: flex attention under the ``BlockMask``
(what CUDA runs) and SDPA under the boolean mask (what the CPU runs), forward and backward."""

from __future__ import annotations

import dataclasses

import torch

from plugtrain.model import FLAVORS, Transformer, cross_entropy
from plugtrain.model.attention import document_mask
from plugtrain.testing import packed_documents

ARGS = dataclasses.replace(FLAVORS["tiny"], attention="document", max_seq_len=256)


def test_flex_attention_gives_the_boolean_masks_loss_and_gradients(device, monkeypatch):
    batch = packed_documents([(100, 28, 1, 127), (256,)], ARGS.vocab_size).to(device)
    model = Transformer(ARGS).to(device)
    model.init_weights(seed=0)

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss = cross_entropy(model(batch.inputs, **batch.model_inputs()), batch.targets)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    flex_loss, flex_grads = loss_and_grads()  # on CUDA: flex attention
    monkeypatch.setattr(model.attend, "mask", lambda tokens, start, docs: document_mask(docs))
    sdpa_loss, sdpa_grads = loss_and_grads()
    assert (flex_loss - sdpa_loss).abs() < 1e-5
    for a, b in zip(flex_grads, sdpa_grads, strict=True):
        assert (a - b).abs().max() < 1e-4
