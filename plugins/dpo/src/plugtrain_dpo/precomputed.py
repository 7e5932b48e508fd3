"""dpo's ``reference = "precomputed"``: the reference's log-probs of every pair the run reads,
computed once before step 1 and stored beside the prepared data.

The reference is the run's starting weights, as ``copy`` freezes them: before step 1 (in
``setup``, which a fresh start runs with those weights) the policy itself runs a no-grad
forward over every sample of the run's datasets (the training sources and the validation
data), with any adapters switched off, sharded as it trains (each data-parallel rank takes
its share, in microbatches of the training's shape) and resharded after: about a third of
the compute of an epoch, once. Each side's summed
log-probability of its completion is kept per document of the prepared store, one float32
each (0 for a padding document), in ``<prepared folder>/reference_logps/<key>.npy``. Data
files are prepared into the cache (``data.cache``), so every run's data has such a folder.

The file's name is its key: a sha256 over the starting weights (every parameter, whole,
whatever the sharding), the model's arguments, the compute dtype and per-document positions,
and the folder's manifest (its data, tokenizer, chat template and ``seq_len``). A run from
another start, or on other data, finds no file of its key and computes its own: a stale one
is never read. A run from the same start on the same data (another ``beta``, a rerun) reads
the file (trl #3985): one line says which. Rank 0 writes the file once, through a
``.partial`` file renamed when complete, so a killed run leaves none half-written under the
name. The checkpoint records the key (32 bytes, not the reference's weights): a resumed run,
whose model at ``setup`` is the seeded init, reads the files of that key and computes none;
if one is gone it stops in one line.

Each microbatch carries its rows' sample numbers (``SetupContext.number_samples``); a row's
document ``d`` is its sample's first stored document plus ``d`` (preference samples start at
a pair), so the lookup is two gathers on the device, with no host sync.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from plugtrain.plugin import (
    MicroBatch,
    PluginError,
    SetupContext,
    additions_off,
    data_parallel_group,
    full_tensor,
)

logger = logging.getLogger("plugtrain")

FOLDER = "reference_logps"
"""Where, in a prepared folder, the reference log-probs computed from it are stored."""
KEY_VERSION = 1
"""Part of every key: a change to what the files hold makes new ones."""

SideSums = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor]]
"""``plugtrain_dpo.side_sums``: from a forward's logits, each document's summed log-prob and
its completion tokens."""


def reference_logps(ctx: SetupContext, side_sums: SideSums) -> ReferenceLogps:
    """The reference log-probs of the run of ``ctx``: on a fresh start, read or computed now
    from the model (the run's start) with ``side_sums``, in microbatches of the training's
    size; on a resume, left for :meth:`ReferenceLogps.load`."""
    training, dims = ctx.config.training, ctx.parallel_dims
    # The training's microbatches: the forward the run compiled, at the shapes it runs.
    logps = ReferenceLogps(ctx, training.batch_size // (dims.dp_size * training.grad_accum_steps))
    if ctx.resuming:  # the model is the seeded init: the checkpoint names the reference
        return logps
    model, adapters = ctx.model, additions_off(ctx.model) or nullcontext()

    def reference(microbatch: MicroBatch) -> torch.Tensor:
        vocabulary = loss_parallel() if dims.tp_enabled else nullcontext()
        with adapters, vocabulary:  # the base model, as copy freezes it
            logits = model(microbatch.inputs, **microbatch.model_inputs())
            return side_sums(logits, microbatch)[0]

    try:
        logps.start(reference_key(ctx), reference)
    finally:
        reshard(model)
    return logps


def weights_digest(model: nn.Module) -> str:
    """A sha256 over every parameter of ``model``, whole (gathered one at a time; each rank
    hashes its share of them), the same for any sharding. Call it on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {}
    for i, (name, param) in enumerate(model.named_parameters()):
        whole = full_tensor(param.detach())  # a collective under FSDP2 and TP
        if i % world == rank:
            if type(whole) is not torch.Tensor:  # a stored form (QLoRA's NF4): its values
                whole = whole.to(torch.float32)
            raw = whole.contiguous().flatten().view(torch.uint8).cpu().numpy()
            mine[name] = f"{whole.dtype} {list(whole.shape)} {hashlib.sha256(raw).hexdigest()}"
    parts = [mine]
    if world > 1:
        parts = [{} for _ in range(world)]
        dist.all_gather_object(parts, mine)
    merged = {k: v for part in parts for k, v in part.items()}
    return hashlib.sha256(json.dumps(merged, sort_keys=True).encode()).hexdigest()


def reference_key(ctx: SetupContext) -> torch.Tensor:
    """The key of the reference ``ctx``'s model is now (the run's start), as 32 uint8 values:
    its weights and what else its log-probs depend on."""
    config = ctx.config
    parts = {
        "version": KEY_VERSION,
        "weights": weights_digest(ctx.model),
        "model": repr(getattr(ctx.model, "args", None)),
        "param_dtype": str(ctx.param_dtype),
        "positions": config.data.reset_positions,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


class ReferenceLogps:
    """The reference log-probs of every document of the run's datasets, on the device, found
    again by each microbatch's sample numbers (see the module doc)."""

    def __init__(self, ctx: SetupContext, rows: int) -> None:
        if not ctx.datasets:
            raise PluginError(
                "dpo.reference = 'precomputed' needs the run's datasets, and this setup "
                "context has none (a unit test's): use plugtrain.testing.make_trainer"
            )
        self.datasets = ctx.number_samples()
        self.dims, self.device, self.rows = ctx.parallel_dims, ctx.device, rows
        self.group = data_parallel_group(self.dims) if self.dims.dp_size > 1 else None
        self.key = torch.zeros(32, dtype=torch.uint8)
        """The reference's key (:func:`reference_key`); what the checkpoint records."""
        self.values: torch.Tensor | None = None
        """Every stored document's log-prob, the datasets' stores one after the other."""
        self.first_documents = torch.zeros(0, dtype=torch.int64)
        """Each numbered sample's first document in :attr:`values`."""
        self.columns = torch.arange(self.datasets[0].seq_len + 1, device=self.device)
        self.computed = 0
        """Samples this process computed the log-probs of (the others were read)."""

    def path(self, index: int) -> Path:
        """Where the log-probs of dataset ``index`` for :attr:`key` are stored."""
        folder = Path(self.datasets[index].stream.folder)  # type: ignore[attr-defined]
        manifest = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
        name = hashlib.sha256(bytes(self.key.tolist()) + manifest.encode()).hexdigest()[:32]
        return folder / FOLDER / f"{name}.npy"

    def start(self, key: torch.Tensor, reference: Callable[[MicroBatch], torch.Tensor]) -> None:
        """A fresh start: the log-probs of reference ``key``, read where stored, else computed
        with ``reference`` (a microbatch's documents' log-probs, ``(rows, documents)``) and
        stored."""
        self.key = key
        tables: dict[Path, torch.Tensor] = {}
        for index, dataset in enumerate(self.datasets):
            path = self.path(index)
            if path in tables:  # the same data twice (validation on the training file)
                continue
            if self._stored(path):
                tables[path] = self._read(path, index, "computed before, from this start")
                continue
            self._check_writable(path)
            if self.dims.is_main:
                logger.info(
                    "dpo: computing the reference log-probs of %s (%d samples) before step 1, "
                    "once: stored in %s",
                    dataset.source,
                    len(dataset),
                    path,
                )
            tables[path] = self._compute(index, reference)
            if self.dims.is_main:
                write_atomically(path, tables[path].cpu().numpy())
        self._index([tables[self.path(i)] for i in range(len(self.datasets))])

    def load(self, key: torch.Tensor) -> None:
        """A resume: the log-probs of the checkpoint's reference ``key``, read; none is
        computed (the start's weights are gone), a missing file is refused in one line."""
        self.key = key.to(torch.uint8).cpu()
        tables = []
        for index, dataset in enumerate(self.datasets):
            path = self.path(index)
            if not path.is_file():
                raise PluginError(
                    f"dpo.reference = 'precomputed': the reference log-probs of "
                    f"{dataset.source} that this run trained with ({path}) are gone, and a "
                    "resumed run has no start weights to compute them: restore the file, or "
                    "start the run again in an empty job.dump_folder"
                )
            tables.append(self._read(path, index, "as the checkpoint's run computed them"))
        self._index(tables)

    def lookup(self, microbatch: MicroBatch, counts: torch.Tensor) -> torch.Tensor:
        """The reference's summed log-probs of ``microbatch``'s documents, laid out as
        ``counts`` (``plugtrain_dpo.completion_counts``), 0 where a document counts none."""
        assert self.values is not None and microbatch.samples is not None
        first = self.first_documents[microbatch.samples]
        documents = first[:, None] + self.columns[: counts.shape[1]]
        found = self.values[documents.clamp_(max=self.values.numel() - 1)]
        return torch.where(counts > 0, found, 0.0)

    def _stored(self, path: Path) -> bool:
        """Whether ``path`` is there, as rank 0 sees it: every rank then does the same."""
        found = [path.is_file()]
        if self.dims.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def _read(self, path: Path, index: int, why: str) -> torch.Tensor:
        dataset = self.datasets[index]
        values = np.load(path)
        expected = dataset.stream.num_documents  # type: ignore[attr-defined]
        if values.shape != (expected,) or values.dtype != np.float32:
            raise PluginError(
                f"{path} holds {values.shape} {values.dtype} values, not one float32 for each "
                f"of the {expected} documents of {dataset.source}: delete it, and it is "
                "computed again"
            )
        if self.dims.is_main:
            logger.info(
                "dpo: reference log-probs of %s read from %s (%s)", dataset.source, path, why
            )
        return torch.from_numpy(values).to(self.device)

    def _check_writable(self, path: Path) -> None:
        folder = path.parent.parent
        if not os.access(folder, os.W_OK):
            raise PluginError(
                f"dpo.reference = 'precomputed' stores the reference log-probs beside the "
                f"prepared data, but {folder} is read-only: make it writable, copy it, or give "
                "the data file itself (prepared into the cache)"
            )

    @torch.no_grad()
    def _compute(self, index: int, reference: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
        """Dataset ``index``'s log-probs, this data-parallel rank computing its share of the
        samples, then summed over the ranks (each document is one rank's)."""
        dataset, dims, rows = self.datasets[index], self.dims, self.rows
        n = len(dataset)
        share = -(-n // dims.dp_size)
        batches = -(-share // rows)  # the same on every rank: FSDP2's collectives pair up
        start = dims.dp_rank * share
        wanted = np.arange(start, start + batches * rows)
        own = torch.from_numpy(wanted < min(n, start + share)).to(self.device)
        indices = np.minimum(wanted, n - 1)  # a rank's last microbatch, filled up
        firsts = torch.from_numpy(dataset.first_documents(indices)).to(self.device)
        values = torch.zeros(dataset.stream.num_documents, device=self.device)  # type: ignore[attr-defined]
        for b in range(batches):
            part = slice(b * rows, (b + 1) * rows)
            microbatch = dataset.collate(indices[part]).to(self.device)
            sums = reference(microbatch)
            assert microbatch.documents is not None
            columns = self.columns[: sums.shape[1]]
            held = columns < microbatch.documents.amax(1, keepdim=True) + 1
            keep = held & own[part, None]
            values[(firsts[part, None] + columns)[keep]] = sums[keep]
        self.computed += int(own.sum())
        if dims.dp_size > 1:
            dist.all_reduce(values, group=self.group)
        return values

    def _index(self, tables: Sequence[torch.Tensor]) -> None:
        """Lay the datasets' tables end to end, with each numbered sample's first document."""
        firsts, offset = [], 0
        for dataset, table in zip(self.datasets, tables, strict=True):
            found = dataset.first_documents(np.arange(len(dataset)))
            firsts.append(torch.from_numpy(found + offset))
            offset += table.numel()
        self.values = torch.cat(list(tables))
        self.first_documents = torch.cat(firsts).to(self.device)


def write_atomically(path: Path, values: np.ndarray) -> None:
    """``values`` as ``path`` (``.npy``), complete or not at all: written to a ``.partial``
    file (one a killed run left is overwritten), flushed to disk, then renamed."""
    path.parent.mkdir(exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        np.save(f, values)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def reshard(model: nn.Module) -> None:
    """Free what FSDP2 still holds gathered after a forward with no backward (the root)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
