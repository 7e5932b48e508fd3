"""A mixture of datasets: their samples interleaved deterministically in proportion to weights.

Positions are dealt to the sources in blocks of :data:`BLOCK`: within a block, each position
goes to the source furthest below its share so far (so every block holds each source's exact
share, to 1/BLOCK), the same for every block. Source ``s``'s ``j``-th sample is sample
``permute(j % n_s)`` of its own permutation for pass ``j // n_s``: a source drawn more than its
size repeats in a new order, one drawn less shows a different subset on each pass. One epoch of
the mixture is long enough for every source to be drawn whole at least once. Everything is
computed per index in O(1) (no table the size of the corpus), and the loader's shuffle and
resume apply unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from plugtrain.data.permutation import permute
from plugtrain.data.pipeline import MicroBatch, PackedDataset, stack_samples
from plugtrain.errors import DataError

BLOCK = 1024
"""Positions per block of the schedule: shares are exact over each block, to 1/BLOCK."""


class MixtureDataset:
    """The samples of ``datasets`` (same ``seq_len``), mixed by ``weights`` (any positive
    numbers) and named ``names`` in logs; ``shuffle`` False reads each source in order. It
    reads like a :class:`PackedDataset` and counts
    the samples drawn from each source (:meth:`shares`)."""

    def __init__(
        self,
        datasets: Sequence[PackedDataset],
        weights: Sequence[float],
        names: Sequence[str],
        *,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.datasets, self.names, self.seed = list(datasets), list(names), seed
        self.shuffle = shuffle
        self.seq_len = datasets[0].seq_len
        self.loss_mask = any(d.loss_mask for d in datasets)
        """Whether some source's targets leave tokens out of the loss."""
        self.source = "data.sources (" + ", ".join(d.source for d in datasets) + ")"
        shares = np.asarray(weights, dtype=np.float64) / sum(weights)
        per_block = np.zeros(len(datasets), dtype=np.int64)
        self._source = np.empty(BLOCK, dtype=np.int64)  # position in block -> source
        self._rank = np.empty(BLOCK, dtype=np.int64)  # -> the source's count before it
        for p in range(BLOCK):
            s = int(np.argmax(shares * (p + 1) - per_block))
            self._source[p], self._rank[p] = s, per_block[s]
            per_block[s] += 1
        for name, count, weight in zip(names, per_block, weights, strict=True):
            if count == 0:
                raise DataError(
                    f"data.sources '{name}' has weight {weight}, too small a share to be drawn "
                    f"once in {BLOCK} samples: raise its weight or leave it out"
                )
        self._per_block = per_block
        blocks = max(math.ceil(len(d) / c) for d, c in zip(datasets, per_block, strict=True))
        self._len = blocks * BLOCK
        self.drawn = np.zeros(len(datasets), dtype=np.int64)
        """Samples read from each source so far (by :meth:`collate`, on this process)."""

    def __len__(self) -> int:
        return self._len

    def locate(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The source of each mixture sample of ``indices``, and its sample in that source."""
        block, position = np.divmod(np.asarray(indices, dtype=np.int64), BLOCK)
        sources = self._source[position]
        j = block * self._per_block[sources] + self._rank[position]
        samples = np.empty_like(j)
        for s in np.unique(sources):  # one vectorised permutation per source and pass
            n = len(self.datasets[s])
            for pass_ in np.unique(j[sources == s] // n):
                mask = (sources == s) & (j // n == pass_)
                ordered = j[mask] % n
                samples[mask] = (
                    ordered if not self.shuffle else permute(ordered, n, self.seed, int(pass_))
                )
        return sources, samples

    def collate(self, indices: Sequence[int]) -> MicroBatch:
        """Stack the samples at ``indices`` into a microbatch of shape [len, seq_len]."""
        sources, samples = self.locate(indices)
        np.add.at(self.drawn, sources, 1)
        return stack_samples(
            [(self.datasets[s], int(i)) for s, i in zip(sources, samples, strict=True)]
        )

    def shares(self) -> dict[str, float]:
        """Each source's share of the samples drawn so far, as metrics ``data_share.<name>``."""
        total = max(int(self.drawn.sum()), 1)
        return {
            f"data_share.{n}": int(c) / total for n, c in zip(self.names, self.drawn, strict=True)
        }
