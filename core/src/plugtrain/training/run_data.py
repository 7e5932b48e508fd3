"""The run's data wiring: the training and validation datasets, opened, and the batch loader.

:func:`open_training_data` opens ``data.train_path`` (or the mixture of ``data.sources``) and
``data.validation_path`` from their prepared folders or data files (see ``data.cache``), with
the documents, positions and loss mask the run uses, and puts the training samples behind the
stateful loader, the device prefetcher and the skipping loader that ``RunControl`` steers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from plugtrain import sample
from plugtrain.config import JobConfig
from plugtrain.data import (
    ChatOptions,
    DevicePrefetcher,
    MixtureDataset,
    PackedDataset,
    SkippingLoader,
    StatefulBatchLoader,
    TokenStore,
    count_eval_batches,
    open_token_store,
)
from plugtrain.distributed import ParallelDims
from plugtrain.plugin import RunControl

logger = logging.getLogger("plugtrain")


@dataclass
class TrainingData:
    """What :func:`open_training_data` opened."""

    train: PackedDataset | MixtureDataset
    """The training samples."""
    validation: PackedDataset | None
    """The validation samples; None without validation (``validation.interval`` 0)."""
    batches: SkippingLoader
    """Each step's microbatches of the training samples, on the device, the skipped ranges
    left out."""


def open_training_data(config: JobConfig, dims: ParallelDims, control: RunControl) -> TrainingData:
    """The run's datasets and its training batches, for this rank of ``dims``; ``control``'s
    skipped ranges are left out of the batches. Resolves ``model.attention`` "auto" from the
    data (``config.resolve_attention``), before the model is built."""
    train_cfg = config.training
    train = _train_dataset(config, dims)
    validation = None
    if config.validation.interval:
        path, key = config.data.validation_path, "data.validation_path"
        validation = _packed(config, _store(config, dims, path, key), path, key)
        # Now rather than at the first validation, which may come many steps later.
        count_eval_batches(
            validation,
            batch_size=train_cfg.batch_size,
            world_size=dims.dp_size,
            max_batches=config.validation.steps,
        )
    loader = StatefulBatchLoader(
        train,
        global_batch_size=train_cfg.batch_size,
        grad_accum_steps=train_cfg.grad_accum_steps,
        rank=dims.dp_rank,
        world_size=dims.dp_size,
        seed=train_cfg.seed,
        shuffle=config.data.shuffle,
    )
    batches = SkippingLoader(DevicePrefetcher(loader, dims.device), control.skip_ranges)
    return TrainingData(train, validation, batches)


def _train_dataset(config: JobConfig, dims: ParallelDims) -> PackedDataset | MixtureDataset:
    """``data.train_path``'s samples, or the mixture of ``data.sources`` when set."""
    data = config.data
    named = [(s["path"], f"data.sources[{i}]") for i, s in enumerate(data.sources)]
    named = named or [(data.train_path, "data.train_path")]
    stores = [_store(config, dims, path, key) for path, key in named]
    # Read before the model is built, so that "auto" attention can follow the data.
    config.resolve_attention(chat=any(store.chat is not None for store in stores))
    datasets = [_packed(config, store, *where) for store, where in zip(stores, named, strict=True)]
    if not data.sources:
        return datasets[0]
    return MixtureDataset(
        datasets,
        [s.get("weight", 1.0) for s in data.sources],
        data.source_names(),
        seed=config.training.seed,
        shuffle=data.shuffle,
    )


def _store(config: JobConfig, dims: ParallelDims, path: str, key: str) -> TokenStore:
    """Config key ``key``'s prepared folder or data file, opened (see data.cache)."""
    data, seq_len = config.data, config.training.seq_len
    chat = ChatOptions(data.format, data.chat_template, seq_len, data.chat_overlong)
    store = open_token_store(
        sample.resolve(path),
        key,
        sample.resolve(config.model.tokenizer_path),
        data.text_field,
        chat=chat,
        is_main=dims.is_main,
        barrier=dist.barrier if dims.world_size > 1 else None,
    )
    if store.chat is not None and dims.is_main:
        counts = store.chat
        logger.info(
            "%s '%s': %d conversations; %d longer than %d tokens truncated, %d dropped "
            "(data.chat_overlong)",
            key,
            path,
            counts["conversations"],
            counts["truncated"],
            counts["max_tokens"],
            counts["dropped"],
        )
    return store


def _packed(config: JobConfig, store: TokenStore, path: str, key: str) -> PackedDataset:
    """``store``'s samples, with the documents, positions and loss mask the run uses."""
    data = config.data
    masked = store.chat is not None and data.chat_loss == "assistant"
    return PackedDataset(
        store,
        config.training.seq_len,
        source=f"{key} '{path}'",
        documents=config.model.attention == "document",
        positions=data.reset_positions is True,
        loss_mask=masked,
    )
