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
    ChatEncoder,
    ChatOptions,
    ChatTemplate,
    DevicePrefetcher,
    MixtureDataset,
    PackedDataset,
    SkippingLoader,
    StatefulBatchLoader,
    TokenStore,
    count_eval_batches,
    fitting_seq_len,
    open_token_store,
)
from plugtrain.distributed import ParallelDims
from plugtrain.errors import DataError
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
    kind: str = "text"
    """What the training data is: ``text``, ``chat`` or ``preference`` (pairs, for DPO)."""
    chat_template: ChatTemplate | None = None
    """The chat template the training data was rendered with (saved with each checkpoint, for
    ``export-hf`` and ``generate --chat``); None for text, or when it cannot be told."""


def run_datasets(
    train: PackedDataset | MixtureDataset, validation: PackedDataset | None
) -> tuple[PackedDataset, ...]:
    """The datasets a run reads: each of ``train``'s sources in order, then ``validation``."""
    sources = train.datasets if isinstance(train, MixtureDataset) else [train]
    return (*sources, *([] if validation is None else [validation]))


def open_training_data(config: JobConfig, dims: ParallelDims, control: RunControl) -> TrainingData:
    """The run's datasets and its training batches, for this rank of ``dims``; ``control``'s
    skipped ranges are left out of the batches. Resolves ``model.attention`` "auto" from the
    data (``config.resolve_attention``), before the model is built."""
    train_cfg = config.training
    train, chat_template, kinds = _train_dataset(config, dims)
    validation = None
    if config.validation.interval:
        path, key = config.data.validation_path, "data.validation_path"
        store = _store(config, dims, path, key)
        _check_validation_kind(store, kinds, path, dims.is_main)
        validation = _packed(config, store, path, key)
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
    (kind,) = kinds if len(kinds) == 1 else ("chat",)  # chat and text mixed: chat's mask
    return TrainingData(train, validation, batches, kind, chat_template)


def _train_dataset(
    config: JobConfig, dims: ParallelDims
) -> tuple[PackedDataset | MixtureDataset, ChatTemplate | None, set[str]]:
    """``data.train_path``'s samples, or the mixture of ``data.sources`` when set, the chat
    template they were rendered with, and their kinds ("chat", "preference", "text")."""
    data = config.data
    named = [(s["path"], f"data.sources[{i}]") for i, s in enumerate(data.sources)]
    named = named or [(data.train_path, "data.train_path")]
    stores = [_store(config, dims, path, key) for path, key in named]
    kinds = {_kind(store) for store in stores}
    # Read before the model is built, so that "auto" attention can follow the data.
    if "preference" in kinds and len(kinds) > 1:
        raise DataError(
            f"the training data mixes preference pairs with {' and '.join(kinds - {'preference'})} "
            "data: train on preference data alone (a DPO run)"
        )
    config.resolve_attention(chat=kinds != {"text"})
    datasets = [_packed(config, store, *where) for store, where in zip(stores, named, strict=True)]
    template = _chat_template(config, dims, stores, named)
    if not data.sources:
        return datasets[0], template, kinds
    mixture = MixtureDataset(
        datasets,
        [s.get("weight", 1.0) for s in data.sources],
        data.source_names(),
        seed=config.training.seed,
        shuffle=data.shuffle,
    )
    return mixture, template, kinds


SAMPLE_VALIDATION = {
    "chat": "sample:chat_validation.jsonl",
    "preference": "sample:preference_validation.jsonl",
    "text": "sample:validation.jsonl",
}
"""The shipped validation data of each kind, named in the line on a mismatched kind."""


def _kind(store: TokenStore) -> str:
    if store.chat is None:
        return "text"
    return "preference" if store.chat.get("preference") else "chat"


def _check_validation_kind(
    store: TokenStore, train_kinds: set[str], path: str, is_main: bool
) -> None:
    """Warn in one line (on the main rank) when the validation data is of another kind than
    all the training data: its loss then tracks a task the run does not train on (a chat run
    validating on the default Shakespeare text saw it rise while the training loss fell).
    Preference pairs on one side only are an error: their loss is not the other's."""
    kind = _kind(store)
    if kind in train_kinds:
        return  # the same kind, or training on both
    (trained,) = train_kinds
    if "preference" in (kind, trained):
        raise DataError(
            f"data.validation_path '{path}' is {kind} data but the training data is {trained}: "
            f"set data.validation_path to {trained} data (the sample's: "
            f"{SAMPLE_VALIDATION[trained]}), or validation.interval 0"
        )
    if not is_main:
        return
    logger.warning(
        "data.validation_path '%s' is %s data but the training data is %s: its loss is not "
        "the trained task's and may rise while the training loss falls; set "
        "data.validation_path to %s data (the sample's: %s)",
        path,
        kind,
        trained,
        trained,
        SAMPLE_VALIDATION[trained],
    )


def _chat_template(
    config: JobConfig, dims: ParallelDims, stores: list[TokenStore], named: list[tuple[str, str]]
) -> ChatTemplate | None:
    """The chat template of the chat ``stores`` (config keys ``named``): the one each
    manifest holds; for a folder prepared before manifests held it, the template
    ``data.chat_template`` gives if the folder's hash is its. None for text, and when one
    cannot be told (said in a line); several are said in a line, and the first is recorded."""
    found: dict[str, ChatTemplate | None] = {}
    for store, (path, key) in zip(stores, named, strict=True):
        chat, where = store.chat, f"{key} '{path}'"
        if chat is None:
            continue
        if "template_source" in chat:
            source, record = chat["template_source"], chat["template_record"]
            found[where] = ChatTemplate.from_record(source, record, where, origin=record["origin"])
            continue
        tokenizer = sample.resolve(config.model.tokenizer_path)
        own = ChatTemplate.for_tokenizer(tokenizer, config.data.chat_template)
        same = ChatEncoder(own).key()["chat_template_sha256"] == chat.get("chat_template_sha256")
        found[where] = own if same else None
    if unknown := [where for where, template in found.items() if template is None]:
        if dims.is_main:
            logger.warning(
                "%s was prepared with a chat template the run cannot read back: checkpoints do "
                "not record it, and export-hf writes the tokenizer's; prepare it again to "
                "record it",
                unknown[0],
            )
        return None
    templates = {t.sha256: t for t in found.values() if t is not None}
    if dims.is_main and len(templates) > 1:
        logger.warning(
            "the chat data was rendered with %d different chat templates (%s): checkpoints "
            "record the first's, which export-hf and generate --chat use",
            len(templates),
            ", ".join(found),
        )
    return next(iter(templates.values()), None)


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
            "(data.chat_overlong)%s",
            key,
            path,
            counts["conversations"],
            counts["truncated"],
            counts["max_tokens"],
            counts["dropped"],
            fitting_seq_len(counts),
        )
    return store


def _packed(config: JobConfig, store: TokenStore, path: str, key: str) -> PackedDataset:
    """``store``'s samples, with the documents, positions and loss mask the run uses."""
    data, seq_len = config.data, config.training.seq_len
    masked = store.chat is not None and data.chat_loss == "assistant"
    if _kind(store) == "preference" and store.chat["max_tokens"] != seq_len:
        raise DataError(
            f"{key} '{path}' packs its preference pairs into samples of seq_len "
            f"{store.chat['max_tokens']}: set training.seq_len {store.chat['max_tokens']}, or "
            f"prepare it again with --max-tokens {seq_len}"
        )
    return PackedDataset(
        store,
        config.training.seq_len,
        source=f"{key} '{path}'",
        documents=config.model.attention == "document",
        positions=data.reset_positions is True,
        loss_mask=masked,
    )
