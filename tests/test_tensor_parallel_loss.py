"""The loss path under tensor parallelism: the loss in chunks (with z-loss's log-sum-exp) on
vocabulary-sharded logits, chat data's summed loss over its counted targets, and document
masking with per-document positions, against the unchunked TP loss and 1 process.

Every multi-process check shares one 2-process (TP 2) launch, which computes in-process on
the tiny model and returns full tensors; the 1-process references are computed here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import loss_parallel

from plugtrain.config import ParallelismConfig
from plugtrain.data import IGNORE_INDEX
from plugtrain.distributed import init_parallel_dims
from plugtrain.model import (
    FLAVORS,
    LLAMA,
    ChunkedLoss,
    Transformer,
    build_model,
    cross_entropy,
    logsumexp,
    parallel_cross_entropy,
    parallel_summed_cross_entropy,
    summed_cross_entropy,
)
from plugtrain.observability import CostCounter
from plugtrain.plugin import full_tensor
from plugtrain.testing import (
    CHAT,
    make_trainer,
    max_difference,
    metrics_by_step,
    run_distributed,
)

TINY = FLAVORS["tiny"]  # vocab 256: 128 a rank under TP 2
CHUNKS = 3  # does not divide the 64 tokens
RUN = (
    "--model.loss_chunks", "2",
    "--plugins.enabled", "z_loss", "--z_loss.weight", "0.1",
    "--validation.interval", "3", "--validation.steps", "1",
)  # fmt: skip
"""A run with the loss in chunks and z-loss, validated at its last step."""
DOCUMENT = dataclasses.replace(TINY, attention="document")
LENGTHS = ((10, 22), (5, 15, 12))
"""Each row's documents, by length."""
COMPARED = ("loss", "z_loss/z_loss", "validation_loss")
LAYOUTS = {"tp2": ("--parallelism.tp", "2"), "one": ("--model.loss_chunks", "1")}
"""The runs of ``RUN`` compared: TP 2 in chunks, and 1 process unchunked."""


def batch(masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of 2 sequences of 32 tokens; ``masked``: the first 20 targets of
    each not counted, as a chat loss mask leaves a prompt's."""
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    targets = tokens[:, 1:].clone()
    if masked:
        targets[:, :20] = IGNORE_INDEX
    return tokens[:, :-1], targets


def packed() -> dict[str, torch.Tensor]:
    """``Transformer.forward``'s documents and positions of ``LENGTHS``' rows."""
    rows = [[(d, p) for d, n in enumerate(row) for p in range(n)] for row in LENGTHS]
    documents, positions = torch.tensor(rows, dtype=torch.int32).unbind(-1)
    return {"documents": documents, "positions": positions}


def loss_and_grads(
    model: torch.nn.Module, chunks: int, masked: bool = False
) -> dict[str, torch.Tensor]:
    """The loss (``masked``: summed over the counted targets), the log-sum-exp and a
    z-loss-like term's, and the full gradients of their sum, unchunked (``chunks`` 1: the
    trainer's TP loss, or the plain one) or in chunks; a document-masking ``model`` reads
    :func:`packed`'s documents."""
    inputs, targets = batch(masked)
    extra = packed() if model.args.attention == "document" else {}
    if chunks == 1:
        logits = model(inputs, **extra)
        plain = not hasattr(logits, "placements")
        if masked:
            loss = (summed_cross_entropy if plain else parallel_summed_cross_entropy)(
                logits, targets
            )
        else:
            loss = (cross_entropy if plain else parallel_cross_entropy)(logits, targets)
        lse = logsumexp(logits.float())
        z = full_tensor(lse.square().mean())  # as z_loss's term reaches the trainer
        lse = full_tensor(lse)
    else:
        head = ChunkedLoss(targets, chunks, with_lse=True, summed=masked)
        loss, lse = model(inputs, **extra, head=head)
        z = lse.square().mean()
    (loss + z).backward()
    grads = {name: full_tensor(p.grad).clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"loss": loss.detach(), "lse": lse.detach(), **grads}


def head_collectives(model: torch.nn.Module) -> dict[str, int]:
    """The collectives of the chunked loss's forward, by name, on the final norm's output."""
    inputs, targets = batch()
    hidden, project = model(inputs, head=lambda h, p: (h, p))
    with CostCounter() as counter:
        ChunkedLoss(targets, CHUNKS, with_lse=True)(hidden, project)
    return dict(counter.collectives)


def on_two_ranks(base: str) -> dict:
    """On each of 2 ranks (TP 2): the loss path's numbers, unchunked and in chunks, of text and
    masked targets, and under document masking; the chunked loss's collectives; and ``RUN``
    trained, on text and chat."""
    train(Path(base), "tp2")
    dims = init_parallel_dims("cpu", ParallelismConfig(tp=2))
    model, document = (
        build_model(
            LLAMA,
            args,
            dims.get_mesh("dp"),
            torch.float32,
            torch.float32,
            dims.device,
            0,
            tp_mesh=dims.get_mesh("tp"),
        )
        for args in (TINY, DOCUMENT)
    )
    with loss_parallel():
        return {
            "whole": loss_and_grads(model, 1),
            "chunked": loss_and_grads(model, CHUNKS),
            "masked_whole": loss_and_grads(model, 1, masked=True),
            "masked_chunked": loss_and_grads(model, CHUNKS, masked=True),
            "document": loss_and_grads(document, 1),
            "collectives": head_collectives(model),
        }


def train(base: Path, layout: str) -> None:
    """``RUN`` in ``layout`` (``LAYOUTS``), on text and on chat data."""
    make_trainer(base / layout, *RUN, *LAYOUTS[layout]).run()
    make_trainer(base / f"chat_{layout}", *RUN, *CHAT, *LAYOUTS[layout]).run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base: Path = tmp_path_factory.mktemp("tp_loss")
    model, document = Transformer(TINY), Transformer(DOCUMENT)
    model.init_weights(0)
    document.init_weights(0)
    one = {
        "whole": loss_and_grads(model, 1),
        "masked": loss_and_grads(model, 1, masked=True),
        "document": loss_and_grads(document, 1),
    }
    train(base, "one")
    ranks = run_distributed(on_two_ranks, 2, str(base))
    names = ("one", "tp2", "chat_one", "chat_tp2")
    metrics = {name: metrics_by_step(base / name) for name in names}
    return {"one": one, "ranks": ranks, "metrics": metrics}


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("reference", ["tp_whole", "one"])
def test_the_chunked_loss_under_tp_is_the_unchunked_tp_loss_and_one_process(
    runs, reference, masked
):
    ranks, prefix = runs["ranks"], "masked_" if masked else ""
    if reference == "tp_whole":
        expected = ranks[0][f"{prefix}whole"]
    else:
        expected = runs["one"]["masked" if masked else "whole"]
    for rank in ranks:
        chunked = rank[f"{prefix}chunked"]
        assert chunked.keys() == expected.keys()
        compared = [chunked, rank[f"{prefix}whole"]] if reference == "one" else [chunked]
        worst = max(relative(ours[k], expected[k]) for ours in compared for k in expected)
        print(f"chunked TP vs {reference}{' (masked)' * masked}: {worst:.3g} relative")
        assert worst < 1e-6, worst
    # Both ranks hold the same replicated loss.
    assert torch.equal(ranks[0][f"{prefix}chunked"]["loss"], ranks[1][f"{prefix}chunked"]["loss"])


@pytest.mark.slow
def test_the_chunked_loss_under_tp_never_gathers_the_logits(runs):
    """One all-gather, of the final norm's positions ([tokens, dim]); the vocabulary's
    reductions (loss_parallel's, the log-sum-exp's max and sum) are all-reduces of a few
    values a token."""
    for rank in runs["ranks"]:
        collectives = rank["collectives"]
        assert collectives.pop("_c10d_functional.all_gather_into_tensor") == 1, collectives
        assert set(collectives) == {"_c10d_functional.all_reduce"}, collectives


@pytest.mark.slow
@pytest.mark.parametrize("data", ["", "chat_"])
def test_a_chunked_z_loss_run_under_tp_trains_as_the_unchunked_one_process_run(runs, data):
    """On chat data too (document masking, per-document positions): the summed loss over the
    counted targets on sharded logits, normalised by their count taken once per TP group."""
    tp2, one = runs["metrics"][f"{data}tp2"], runs["metrics"][f"{data}one"]
    assert all(k in tp2[3] for k in COMPARED), sorted(tp2[3])
    difference = max_difference(tp2, one, range(1, 4), COMPARED)
    print(f"{data}TP 2 chunked vs 1 process unchunked: max difference {difference:.3g}")
    assert difference < 1e-5, difference


@pytest.mark.slow
def test_document_masking_under_tp_is_one_process_document_masking(runs):
    """Heads split over the ranks, the mask and positions per token: the same loss, log-sum-exp
    and gradients within fp32 rounding; and not those of causal attention (the mask acts)."""
    expected, causal = runs["one"]["document"], runs["one"]["whole"]
    for rank in runs["ranks"]:
        worst = max(relative(rank["document"][k], expected[k]) for k in expected)
        print(f"document masking, TP 2 vs 1 process: {worst:.3g} relative")
        assert worst < 1e-6, worst
    assert max(relative(expected[k], causal[k]) for k in expected) > 0.1
