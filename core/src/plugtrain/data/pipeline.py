"""Data pipeline: documents -> one token stream -> fixed-length samples -> batches.

The pipeline is deliberately simple and fully deterministic, so that runs are reproducible and
resumable bit for bit:

1. The token stream: a prepared folder read by memory map (:mod:`plugtrain.data.store`), each
   document framed Llama-style as ``<|begin_of_text|> tokens <|end_of_text|>``.
2. :class:`PackedDataset` cuts the stream into non-overlapping samples of ``seq_len + 1``
   tokens (inputs, and targets shifted by one); documents run across sample boundaries.
   Only the samples drawn are read. Asked to, it also gives each input token's document
   (numbered from 0 in its row, from the store's document boundaries) and its position within
   that document, for document masking and per-document RoPE positions. With a loss mask
   (chat data), the targets that are not the assistant's are :data:`IGNORE_INDEX`, which the
   cross-entropy leaves out: the mask travels in the batch's targets, with no tensor of its
   own and no read of the device.
3. :class:`StatefulBatchLoader` draws training batches from a per-epoch permutation, split
   across data-parallel ranks and gradient-accumulation microbatches, with a world-size
   independent ``state_dict``; :func:`iter_eval_batches` does the same, unshuffled, for
   validation.

Every error a user can cause (a file too small for one sample or one batch, a batch size
that does not divide) is a one-line :class:`DataError` naming the config key and file; the
trainer meets each while it is built, before step 1 (:func:`count_eval_batches` included).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from plugtrain.data.permutation import permute
from plugtrain.errors import DataError

IGNORE_INDEX = -100
"""The target of a token the loss leaves out (``F.cross_entropy``'s default ``ignore_index``,
and transformers' label for it)."""


class MicroBatch(NamedTuple):
    """One microbatch: ``inputs`` and ``targets``, int64 token ids of shape ``[batch, seq_len]``
    (targets are inputs shifted by one, :data:`IGNORE_INDEX` where the loss mask leaves one
    out), and what the model needs besides, when the run asks.

    ``documents`` is the document of each input token, int32 ``[batch, seq_len]``, numbered
    from 0 in each row (``0 0 0 1 1 2 ...``; a row that starts inside a document starts at 0
    too): the model attends only within a document (``model.attention = "document"``). A
    sequence that should be one unit (a conversation) is one document. ``positions`` is each
    input token's position within its document, int32 (``0 1 2 0 1 0 ...``), its RoPE position
    (``data.reset_positions``). ``samples`` is each row's sample, int64 ``[batch]``: its
    number in the run's numbering of every sample it reads (``SetupContext.number_samples``),
    the same in every epoch, on every rank and after a resume, for a plugin that keeps values
    per sample (dpo's precomputed reference). Each is None when the run does not use it.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    samples: torch.Tensor | None = None

    def to(self, device: torch.device, *, pin: bool = False) -> MicroBatch:
        """The microbatch on ``device``; ``pin``: copied from pinned memory without blocking the
        host (CUDA)."""
        if device.type == "cpu":
            return self
        return MicroBatch(
            *(
                None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=pin)
                for t in self
            )
        )

    @classmethod
    def concatenate(cls, batch: Sequence[MicroBatch]) -> MicroBatch:
        """``batch``'s microbatches as one, their rows one after another (a pipeline schedule
        splits them back)."""
        if len(batch) == 1:
            return batch[0]
        return cls(
            *(None if parts[0] is None else torch.cat(parts) for parts in zip(*batch, strict=True))
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of ``Transformer.forward`` this microbatch carries (none in a
        run without document masking or per-document positions)."""
        extra = {"documents": self.documents, "positions": self.positions}
        return {k: v for k, v in extra.items() if v is not None}


class TokenStream(Protocol):
    """A 1-D token stream read by position: a :class:`~plugtrain.data.store.TokenStore`."""

    num_tokens: int

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream."""
        ...

    def documents(self, start: int, length: int) -> np.ndarray:
        """The document of each token ``[start, start + length)``, numbered from 0."""
        ...

    def read_mask(self, start: int, length: int) -> np.ndarray | None:
        """Whether each of those tokens counts in the loss (nonzero), or None: all do."""
        ...

    def document_of(self, positions: np.ndarray) -> np.ndarray:
        """The document each token position of ``positions`` is in, numbered from 0 over the
        stream (int64)."""
        ...


class Samples(Protocol):
    """What the loaders draw from: a :class:`PackedDataset`, or a mixture of several."""

    seq_len: int
    source: str
    """Where the samples come from, for error messages."""

    def __len__(self) -> int: ...

    def collate(self, indices: Sequence[int]) -> MicroBatch:
        """Stack the samples at ``indices`` into (inputs, targets) of shape [len, seq_len]."""
        ...


class PackedDataset:
    """Non-overlapping samples of ``seq_len + 1`` consecutive tokens of a stream.

    Sample ``i`` covers ``stream[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]``; its inputs are
    the first ``seq_len`` tokens and its targets the last ``seq_len``. The tail of the stream
    shorter than one sample is dropped. ``stream`` is a memory-mapped
    :class:`~plugtrain.data.store.TokenStore` (or any :class:`TokenStream`), whose tokens are
    read only when a sample is. ``source`` names where the stream came from in error messages
    (``data.validation_path 'val.jsonl'``). ``documents`` and ``positions`` add those of
    :class:`MicroBatch` to every batch. With ``loss_mask``, the targets of tokens the
    stream's mask leaves out (:meth:`TokenStream.read_mask`) are :data:`IGNORE_INDEX`.
    """

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        *,
        source: str = "the token stream",
        documents: bool = False,
        positions: bool = False,
        loss_mask: bool = False,
    ) -> None:
        self._stream = stream
        self.documents, self.positions = documents, positions
        self.loss_mask = loss_mask
        """Whether targets outside the stream's mask are :data:`IGNORE_INDEX`."""
        if seq_len < 1:
            raise DataError(f"training.seq_len must be >= 1, got {seq_len}")
        num_tokens = self._stream.num_tokens
        if num_tokens < seq_len + 1:
            raise DataError(
                f"{source} has {num_tokens} tokens, fewer than the {seq_len + 1} needed "
                f"for one sample of seq_len={seq_len}: lower training.seq_len, or use a "
                f"larger file"
            )
        self.seq_len = seq_len
        self.source = source
        self._num_samples = num_tokens // (seq_len + 1)
        self.first_sample: int | None = None
        """The run's number of sample 0 (``SetupContext.number_samples``; sample ``i``'s is
        ``first_sample + i``), or None: the batches carry no ``samples``."""

    @property
    def stream(self) -> TokenStream:
        """The token stream the samples are read from (a run's: a
        :class:`~plugtrain.data.store.TokenStore`, with its folder and manifest)."""
        return self._stream

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, index: int) -> MicroBatch:
        """(inputs, targets) of sample ``index``, int64 tensors of shape [seq_len]."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        batch = self.collate([index])
        return batch.inputs[0], batch.targets[0]

    def tokens(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``index`` (inputs, then the last target)."""
        width = self.seq_len + 1
        return self._stream.read(index * width, width)

    def sample_documents(self, index: int) -> np.ndarray:
        """The document of each input token of sample ``index`` (see :class:`MicroBatch`)."""
        return self._stream.documents(index * (self.seq_len + 1), self.seq_len)

    def collate(self, indices: Sequence[int]) -> MicroBatch:
        """Stack the samples at ``indices`` into a microbatch of shape [len, seq_len]."""
        return stack_samples([(self, int(i)) for i in indices])

    def first_documents(self, indices: np.ndarray) -> np.ndarray:
        """The document of the stream (numbered from 0 over it, int64) each sample of
        ``indices`` starts in: with :class:`MicroBatch` ``documents``, a row's document ``d``
        is the stream's ``first_documents([sample])[0] + d`` where samples start at a document
        (preference data's)."""
        return self._stream.document_of(np.asarray(indices, dtype=np.int64) * (self.seq_len + 1))

    def counted(self, index: int) -> np.ndarray | None:
        """Which of sample ``index``'s ``seq_len`` targets count in the loss (nonzero), or
        None without ``loss_mask``: all do."""
        if not self.loss_mask:
            return None
        return self._stream.read_mask(index * (self.seq_len + 1) + 1, self.seq_len)


def stack_samples(samples: Sequence[tuple[PackedDataset, int]]) -> MicroBatch:
    """The microbatch of ``samples`` (dataset, index): int64 inputs and targets of shape
    [len(samples), seq_len], the targets each dataset's loss mask leaves out
    :data:`IGNORE_INDEX`, and the documents, positions and sample numbers their datasets ask
    for."""
    rows = torch.from_numpy(np.stack([d.tokens(i) for d, i in samples]).astype(np.int64))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    counted = [d.counted(i) for d, i in samples]
    if any(c is not None for c in counted):
        full = np.ones(targets.shape[1], dtype=np.uint8)
        left_out = np.stack([full if c is None else c for c in counted]) == 0
        targets = targets.masked_fill(torch.from_numpy(left_out), IGNORE_INDEX)
    documents = positions = None
    first = samples[0][0]
    if first.documents or first.positions:
        ids = np.stack([d.sample_documents(i) for d, i in samples])
        documents = torch.from_numpy(ids) if first.documents else None
        positions = torch.from_numpy(document_positions(ids)) if first.positions else None
    numbers = None
    if first.first_sample is not None:  # numbered: then every dataset of the run is
        numbered = [(d.first_sample or 0) + i for d, i in samples]
        numbers = torch.tensor(numbered, dtype=torch.int64)
    return MicroBatch(inputs, targets, documents, positions, numbers)


def document_positions(documents: np.ndarray) -> np.ndarray:
    """Each token's position within its document, int32, from ``documents`` [rows, seq_len]
    (``0 0 0 1 1 2`` gives ``0 1 2 0 1 0``)."""
    index = np.arange(documents.shape[1], dtype=np.int32)
    starts = np.ones(documents.shape, dtype=bool)  # where each document begins in its row
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")


class StatefulBatchLoader:
    """Deterministic, resumable, data-parallel sampler of training batches.

    Each optimizer step consumes the next ``global_batch_size`` indices of the current epoch's
    order (a permutation keyed by ``(seed, epoch)`` and computed only for the indices drawn,
    see :mod:`plugtrain.data.permutation`; the identity without shuffling); an
    epoch's remainder shorter than a global batch is skipped. The global batch is cut into
    ``world_size`` contiguous rank slices, each cut into ``grad_accum_steps`` contiguous
    microbatches, so the union over ranks and microbatches is the same set of samples for any
    ``world_size`` and ``grad_accum_steps``. The state (epoch, samples consumed in it) is the
    same on every rank and independent of the world size, so a run may resume on a different
    number of ranks and continue the same global sample sequence.
    """

    def __init__(
        self,
        dataset: Samples,
        *,
        global_batch_size: int,
        grad_accum_steps: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        _check_rank(rank, world_size)
        if grad_accum_steps < 1:
            raise DataError(f"training.grad_accum_steps must be >= 1, got {grad_accum_steps}")
        parts = world_size * grad_accum_steps
        if global_batch_size < 1 or global_batch_size % parts:
            raise DataError(
                f"training.batch_size={global_batch_size} is not a positive multiple of "
                f"world_size * grad_accum_steps = {world_size} * {grad_accum_steps} = {parts}: "
                f"set training.batch_size to a multiple of {parts} or change grad_accum_steps"
            )
        if global_batch_size > len(dataset):
            raise DataError(
                f"training.batch_size={global_batch_size} exceeds the {len(dataset)} training "
                f"samples of seq_len={dataset.seq_len} in {dataset.source}: lower "
                f"training.batch_size or training.seq_len, or use a larger file"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.micro_batch_size = global_batch_size // parts
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0  # samples of the epoch's order already consumed

    def next_batch(self) -> list[MicroBatch]:
        """This rank's ``grad_accum_steps`` microbatches of the next optimizer step."""
        n = len(self.dataset)
        if self._position + self.global_batch_size > n:
            self._epoch += 1
            self._position = 0
        per_rank = self.global_batch_size // self.world_size
        start = self._position + self.rank * per_rank
        indices = np.arange(start, start + per_rank)
        if self.shuffle:
            indices = permute(indices, n, self.seed, self._epoch)
        self._position += self.global_batch_size
        mbs = self.micro_batch_size
        return [
            self.dataset.collate(indices[m * mbs : (m + 1) * mbs])
            for m in range(self.grad_accum_steps)
        ]

    def state_dict(self) -> dict[str, int]:
        """Where the global sample sequence stands; identical on every rank."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` (possibly saved with another world size)."""
        if set(state_dict) != {"epoch", "position"}:
            raise DataError(
                f"data loader state has keys {sorted(state_dict)}, expected ['epoch', "
                f"'position']: the checkpoint was not written by StatefulBatchLoader"
            )
        epoch, position = state_dict["epoch"], state_dict["position"]
        if not (isinstance(epoch, int) and isinstance(position, int)):
            raise DataError(f"data loader state {state_dict} must hold two ints")
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise DataError(
                f"data loader state {state_dict} is out of range for the {len(self.dataset)} "
                f"samples of {self.dataset.source}: the checkpoint was trained on other data or "
                f"seq_len; resume with those, or train in another job.dump_folder"
            )
        self._epoch, self._position = epoch, position


def count_eval_batches(
    dataset: PackedDataset, *, batch_size: int, world_size: int, max_batches: int | None = None
) -> int:
    """How many validation batches :func:`iter_eval_batches` yields for these arguments.

    The trainer calls it while it is built, so that a validation file too small for one batch
    stops the run before step 1 rather than at its first validation. Raises a one-line
    :class:`DataError` when the batch size does not divide or no batch fits.
    """
    if batch_size < 1 or batch_size % world_size:
        raise DataError(
            f"eval batch size {batch_size} is not a positive multiple of "
            f"world_size={world_size}: set training.batch_size to a multiple of {world_size}"
        )
    if max_batches is not None and max_batches < 1:
        raise DataError(f"validation.steps must be >= 1, got {max_batches}")
    num_batches = len(dataset) // batch_size
    if num_batches == 0:
        raise DataError(
            f"{dataset.source} has {len(dataset)} samples of seq_len={dataset.seq_len}, fewer "
            f"than one validation batch of training.batch_size={batch_size}: lower "
            f"training.batch_size or training.seq_len, or use a larger validation file"
        )
    return num_batches if max_batches is None else min(num_batches, max_batches)


def iter_eval_batches(
    dataset: PackedDataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    max_batches: int | None = None,
) -> Iterator[MicroBatch]:
    """This rank's share of the validation batches, in dataset order (no shuffling).

    ``batch_size`` is global (over all ranks, like ``training.batch_size``), so the samples
    evaluated do not depend on the world size. Batch ``b`` covers samples ``[b * batch_size,
    (b + 1) * batch_size)``; rank ``r`` gets the ``r``-th contiguous ``batch_size //
    world_size`` of them, in one forward pass. Every rank yields the same number of batches,
    as sharded forward passes require: the remainder shorter than one batch is dropped, and at
    most ``max_batches`` are yielded. Raises :class:`DataError` (right away, not on first
    iteration) when that leaves no batch at all: see :func:`count_eval_batches`.
    """
    _check_rank(rank, world_size)
    num_batches = count_eval_batches(
        dataset, batch_size=batch_size, world_size=world_size, max_batches=max_batches
    )
    per_rank = batch_size // world_size
    starts = (b * batch_size + rank * per_rank for b in range(num_batches))
    return (dataset.collate(range(start, start + per_rank)) for start in starts)
