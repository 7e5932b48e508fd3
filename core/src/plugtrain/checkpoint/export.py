"""Export a checkpoint to a Hugging Face folder, one tensor in memory at a time.

The folder holds ``model.safetensors`` (or shards and ``model.safetensors.index.json``),
``config.json``, ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``:
``transformers.LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it
with no other file. A run on chat data exports the chat template it trained with (the one its
checkpoint records, plugtrain's default included), as ``chat_template.jinja`` and as
``tokenizer_config.json``'s ``chat_template``, so that ``apply_chat_template`` gives the ids it
trained on; a text run (or one saved before the template was recorded) exports the template of
its tokenizer's folder when that has its own, and none otherwise. The exported
tokenizer puts ``<|begin_of_text|>`` before a text, as Llama 3's does and as plugtrain lays
out its training documents, prompts and scored contexts: with its default
``add_special_tokens``, ``AutoTokenizer(...)(text)`` gives the ids the model was trained and
is scored on (``add_bos_token=False`` turns it off).

:func:`export_checkpoint` reads a DCP checkpoint key by key (``plugtrain export-hf``);
:func:`write_hf_folder` takes any source of full tensors (the ``hf_export`` plugin gathers them
from a sharded model).

The safetensors files are written by hand rather than with ``safetensors.torch.save_file``,
which needs every tensor of a file in memory at once. The format is a little-endian u64 header
length, a JSON header (dtype, shape and byte range of each tensor) and the raw bytes; the shapes
are known from the model's config before any tensor is read, so each file's header is written
first and the tensors stream after it. The output is built in ``OUT.partial`` and renamed to
``OUT`` when complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plugtrain.checkpoint.base import base_loader
from plugtrain.checkpoint.dcp_io import TensorOnlyLoadPlanner, read_metadata
from plugtrain.checkpoint.saved import WEIGHTS, SavedCheckpoint, open_checkpoint
from plugtrain.data import BOS_TOKEN, DEFAULT_CHAT_TEMPLATE, EOS_TOKEN, ChatTemplate, Tokenizer
from plugtrain.errors import CheckpointError, UserError, one_line
from plugtrain.model import AdapterExport, Conversion, HFAdapter, LazyTensors

__all__ = [
    "export_adapter",
    "export_checkpoint",
    "parse_size",
    "unexported_bias",
    "write_hf_folder",
]

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
"""The dtypes an export writes, by their safetensors name."""
_SIZE = re.compile(r"(\d+)\s*([KMG]i?B)?", re.IGNORECASE)
_BIAS = "moe.expert_bias"
"""The moe family's selection bias in a checkpoint (the trainer's ``moe`` state)."""
_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """Bytes of ``"5GB"``, ``"200MiB"``, ``"1000"`` (Hugging Face's ``max_shard_size`` form)."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match[1]) < 1:
        raise UserError(f"size '{text}' is not a positive size: write e.g. 5GB, 500MB or 2GiB")
    return int(match[1]) * _UNITS[(match[2] or "").lower()]


def export_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    weights: str = "model",
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
    conversion: Conversion | None = None,
) -> tuple[Path | str, torch.dtype]:
    """Write checkpoint ``path`` (a dump folder or a ``step-N/`` folder, see
    :func:`~plugtrain.checkpoint.saved.open_checkpoint`) as a Hugging Face folder ``out``,
    reading one tensor at a time; returns the checkpoint folder exported and the dtype written.
    ``dtype`` None keeps the dtype the checkpoint stores the weights in (float32 for a run's:
    the export computes what the checkpoint does). ``tokenizer`` replaces the tokenizer.json
    the run's config names (a relative path the run read from elsewhere). ``conversion``
    holds the export rules of the parameters a plugin added to the run's model (see
    ``plugtrain.training.conversion``): they are merged into the base weights or dropped."""
    saved = open_checkpoint(path, tokenizer)
    folder, args, prefix, hf = saved.folder, saved.args, WEIGHTS[weights], saved.spec.hf
    stored, keys = _stored(saved, weights, conversion)
    if dtype is None:  # the widest the checkpoint holds, should its tensors differ
        dtype = max({md.properties.dtype for _, md in keys.values()}, key=lambda d: d.itemsize)
    shapes = hf.parameter_shapes(args)
    for name, md in stored.items():
        if name not in shapes:
            hf.to_hf(name, torch.empty(0), args)  # raises: the format has no place for it
        if tuple(md.size) != shapes[name]:
            raise CheckpointError(
                f"checkpoint '{folder}' holds '{prefix}{name}' of shape {tuple(md.size)}, but "
                f"its config ({saved.config['model']['flavor']}, vocab {args.vocab_size}) gives "
                f"{shapes[name]}: export with the tokenizer and flavor of the run that saved it"
            )
    missing = {name for name in shapes if name not in stored}
    if missing - (set() if conversion is None else conversion.unsaved):
        first = next(name for name in shapes if name in missing)
        raise CheckpointError(
            f"checkpoint '{folder}' lacks '{prefix}{first}': export a complete checkpoint"
        )
    # The frozen base weights a checkpoint leaves out: from the initial load, hash checked.
    load = _loader(saved, keys, base_loader(saved, missing) if missing else None)
    write_hf_folder(
        out,
        args,
        load if conversion is None else conversion.exported(load),
        hf=hf,
        tokenizer_path=saved.tokenizer_path,
        chat_template=saved.chat_template,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )
    return folder, dtype


def unexported_bias(saved: SavedCheckpoint) -> str | None:
    """A line saying what an export of ``saved`` loses, if its experts' selection bias (a
    ``moe`` run's with ``model.moe_bias_update_rate``) is not zero: Qwen3-MoE's format has no
    place for it, and without it the router picks other experts; None otherwise."""
    md = read_metadata(saved.folder, saved.source.reader()).state_dict_metadata.get(_BIAS)
    if not isinstance(md, TensorStorageMetadata):
        return None
    largest = _loader(saved, {_BIAS: (_BIAS, md)})(_BIAS).abs().max().item()
    if largest == 0:
        return None
    return (
        f"the checkpoint's expert selection bias ({_BIAS}, max |bias| {largest:.4g}) has no "
        "place in the Hugging Face format and is left out: the exported router picks experts "
        "without it, not as the trained model did (transformers' logits differ)"
    )


def export_adapter(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    weights: str = "model",
    overwrite: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
    conversion: Conversion | None = None,
) -> tuple[Path | str, torch.dtype]:
    """Write the adapter of checkpoint ``path`` (``plugtrain export-hf --adapter``) as folder
    ``out``, in the format of the plugin that added it (``conversion.adapter``, set in
    ``convert_model``; lora's is a Hugging Face peft folder); returns the checkpoint folder
    exported and the dtype written (``dtype`` None: the checkpoint's). A run whose plugins
    added no adapter is refused in one line, and nothing is written."""
    saved = open_checkpoint(path, tokenizer)
    if conversion is None or conversion.adapter is None:
        raise UserError(
            f"checkpoint '{saved.folder}' holds no adapter (no plugin of its run, such as lora, "
            "writes one): export the whole model without --adapter"
        )
    _, keys = _stored(saved, weights, conversion)
    if dtype is None:
        dtype = max(
            {keys[n][1].properties.dtype for n in conversion.added}, key=lambda d: d.itemsize
        )
    if dtype not in _SAFETENSORS_DTYPES:
        raise UserError(f"cannot export in {dtype}: choose float32, bfloat16 or float16")
    load = _loader(saved, keys)
    _, writer = conversion.adapter
    with _staged(out, overwrite) as folder:
        writer(
            AdapterExport(
                folder=folder,
                tensors=LazyTensors(tuple(sorted(conversion.added)), load),
                to_hf=lambda name, t: saved.spec.hf.to_hf(name, t, saved.args),
                base_model=saved.config.get("checkpoint", {}).get("initial_load_path", ""),
                dtype=dtype,
            )
        )
    return saved.folder, dtype


def _loader(
    saved: SavedCheckpoint,
    keys: Mapping[str, tuple[str, TensorStorageMetadata]],
    left_out: Callable[[str], torch.Tensor] | None = None,
) -> Callable[[str], torch.Tensor]:
    """The reader of parameter ``name``'s full tensor from ``saved`` (``keys``: its DCP key and
    metadata, from :func:`_stored`), in this process alone; ``left_out`` reads those the
    checkpoint does not hold (``checkpoint.base``)."""

    def load(name: str) -> torch.Tensor:
        if name not in keys and left_out is not None:
            return left_out(name)
        key, md = keys[name]
        tensor = torch.empty(md.size, dtype=md.properties.dtype)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(
                    {key: tensor},
                    storage_reader=saved.source.reader(),
                    planner=TensorOnlyLoadPlanner(),
                    no_dist=True,
                )
        except (Exception, dcp.CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint '{saved.folder}' is damaged: cannot read '{key}' "
                f"({one_line(e)}); export another checkpoint of the run"
            ) from e
        return tensor

    return load


def _stored(
    saved: SavedCheckpoint, weights: str, conversion: Conversion | None
) -> tuple[dict[str, TensorStorageMetadata], dict[str, tuple[str, TensorStorageMetadata]]]:
    """The stored base tensors of ``weights``, by name, and the DCP key and metadata of every
    tensor the export reads (the added ones of ``conversion`` too)."""
    prefix, stored = WEIGHTS[weights], saved.tensors(weights)
    added = {} if conversion is None else conversion.added
    if missing := [name for name in added if name not in stored]:
        raise CheckpointError(
            f"checkpoint '{saved.folder}' lacks '{prefix}{missing[0]}', which plugin "
            f"'{added[missing[0]].plugin}' adds: export a checkpoint of its run"
        )
    shapes = saved.spec.hf.parameter_shapes(saved.args)
    # A converted run's tensor that none of its plugins adds (one plugin of several not
    # enabled where the export runs); without any, the format's own refusal names it.
    if added and (unknown := [n for n in stored if n not in added and n not in shapes]):
        raise CheckpointError(
            f"checkpoint '{saved.folder}' holds '{prefix}{unknown[0]}', which neither the model "
            "nor a plugin its run's config enables adds: export where the plugin that added it "
            "is installed and enabled in that run's plugins.enabled"
        )
    keys = {name: (prefix + name, md) for name, md in stored.items()}
    base = {name: md for name, md in stored.items() if name not in added}
    if conversion is not None and weights != "model":
        # A weight set of trainable parameters (ema's) takes the frozen ones from the model's.
        for name, md in saved.tensors("model").items():
            if name in conversion.frozen and name not in base:
                base[name], keys[name] = md, (WEIGHTS["model"] + name, md)
    return base, keys


def _write(f: Any, data: Any) -> None:
    """Write ``data`` (bytes or a buffer) to file ``f``; tests replace it to fill the disk."""
    f.write(data)


def _header(names: list[str], shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> bytes:
    """A safetensors header for ``names`` stored in this order, padded to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        size = torch.empty(0, dtype=dtype).element_size() * torch.Size(shapes[name]).numel()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """``sizes``' names in order, cut into files of at most ``max_bytes`` (or one tensor)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name, size in sizes.items():
        if shards[-1] and total + size > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += size
    return shards


def _bos_processor(spec: dict[str, Any], bos_id: int | None) -> dict[str, Any] | None:
    """The post-processor of an exported tokenizer.json whose own is ``spec["post_processor"]``:
    ``<|begin_of_text|>`` first (when the tokenizer has it) and no other special token, as the
    data pipeline places them (its EOS ends a training document, not a prompt). A ``ByteLevel``
    step is kept: it changes offsets only."""
    own = spec.get("post_processor") or {}
    steps = own.get("processors", []) if own.get("type") == "Sequence" else [own]
    kept = [step for step in steps if step.get("type") == "ByteLevel"]
    if bos_id is not None:
        bos = {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}
        kept.append(
            {
                "type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [
                    bos,
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {
                    BOS_TOKEN: {"id": BOS_TOKEN, "ids": [bos_id], "tokens": [BOS_TOKEN]}
                },
            }
        )
    if len(kept) > 1:
        return {"type": "Sequence", "processors": kept}
    return kept[0] if kept else None


def _tokenizer_files(tokenizer_path: Path, args: Any) -> tuple[dict, dict, dict, dict]:
    """tokenizer.json, tokenizer_config.json, generation_config.json and the special token ids,
    from the tokenizer.json the run trained with."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    spec = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    spec["post_processor"] = _bos_processor(spec, tokenizer.bos_id)
    padding = spec.get("padding") or {}
    tokens = {
        "bos": (BOS_TOKEN, tokenizer.bos_id) if tokenizer.bos_id is not None else (None, None),
        "eos": (EOS_TOKEN, tokenizer.eos_id),
        "pad": (padding.get("pad_token"), padding.get("pad_id")),
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{kind}_token": token for kind, (token, _) in tokens.items() if token is not None},
        "add_bos_token": tokenizer.bos_id is not None,
        "add_eos_token": False,
        "model_max_length": args.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    ids = {f"{kind}_token_id": token_id for kind, (_, token_id) in tokens.items()}
    generation_config = {k: v for k, v in ids.items() if v is not None}
    return spec, tokenizer_config, generation_config, ids


def write_hf_folder(
    out: str | os.PathLike[str],
    args: Any,
    load: Callable[[str], torch.Tensor],
    *,
    hf: HFAdapter,
    tokenizer_path: str | os.PathLike[str],
    dtype: torch.dtype,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    chat_template: ChatTemplate | None = None,
) -> Path:
    """Write a Hugging Face folder ``out`` for a model of shape ``args``, in its family's
    format ``hf``, with ``chat_template`` (the one the run trained with; None: the tokenizer
    folder's own, if any).

    ``load(name)`` gives the full tensor of plugtrain parameter ``name``; it is called once per
    parameter in the model's order, and only that tensor (and its converted copy) is held.
    Every floating tensor is cast to ``dtype``. The folder is built in ``out.partial`` and
    renamed when complete; an existing non-empty ``out`` is refused unless ``overwrite``.
    """
    _refuse_occupied(Path(out), overwrite)
    if dtype not in _SAFETENSORS_DTYPES:
        raise UserError(f"cannot export in {dtype}: choose float32, bfloat16 or float16")
    tokenizer_files = _tokenizer_files(Path(tokenizer_path), args)
    with _staged(out, overwrite) as partial:
        _write_weights(partial, args, hf, load, dtype, max_shard_size)
        template = chat_template or _own_template(Path(tokenizer_path))
        _write_configs(partial, args, hf, dtype, template, tokenizer_files)
    return Path(out)


def _refuse_occupied(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(
            f"'{out}' exists and is not empty: choose another -o folder, or pass --overwrite"
        )


@contextlib.contextmanager
def _staged(out: str | os.PathLike[str], overwrite: bool) -> Iterator[Path]:
    """The folder to write ``out``'s files into, ``out.partial``, renamed to ``out`` when the
    body completes and removed if it fails; a non-empty ``out`` is refused unless
    ``overwrite``, and a failed write is a one-line :class:`UserError`."""
    out = Path(out)
    _refuse_occupied(out, overwrite)
    partial = out.with_name(out.name + ".partial")
    try:
        if partial.exists():  # left by an export that crashed
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        yield partial
        if out.exists():
            doomed = out.with_name(out.name + ".deleting")
            out.rename(doomed)
            shutil.rmtree(doomed)
        partial.rename(out)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError):
            why = "disk full" if e.errno == errno.ENOSPC else one_line(e)
            raise UserError(
                f"cannot write '{out}' ({why}; nothing was left there): free space on its disk "
                "or choose another -o folder"
            ) from e
        raise


def _write_weights(
    folder: Path,
    args: Any,
    hf: HFAdapter,
    load: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    max_shard_size: int,
) -> None:
    """Write the model's safetensors files in format ``hf`` into ``folder``, one tensor at a
    time (``load``, see :func:`write_hf_folder`), in shards of at most ``max_shard_size`` bytes
    with their index."""
    shapes = hf.parameter_shapes(args)
    # A stacked parameter (a layer's experts) is stored as one tensor per index of its first
    # dimension, each of its shape less that dimension.
    hf_names = {name: hf.hf_names(name, shape, args) for name, shape in shapes.items()}
    hf_shapes = {
        hf_name: shape[1:] if hf.stacked(name, args) else shape
        for name, shape in shapes.items()
        for hf_name in hf_names[name]
    }
    item = torch.empty(0, dtype=dtype).element_size()
    sizes = {name: item * torch.Size(shape).numel() for name, shape in shapes.items()}
    shards = _shards(sizes, max_shard_size)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        with open(folder / file, "wb") as f:
            _write(f, _header([h for n in names for h in hf_names[n]], hf_shapes, dtype))
            for name in names:
                tensor = load(name)
                if tuple(tensor.shape) != shapes[name]:
                    raise CheckpointError(
                        f"tensor '{name}' has shape {tuple(tensor.shape)}, but the model's "
                        f"config gives {shapes[name]}: export the checkpoint of this model"
                    )
                for hf_name, piece in hf.pieces_to_hf(name, tensor, args):
                    piece = piece.to(dtype).contiguous()
                    _write(f, piece.reshape(-1).view(torch.uint8).numpy())
                    weight_map[hf_name] = file
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index)


def _write_configs(
    folder: Path,
    args: Any,
    hf: HFAdapter,
    dtype: torch.dtype,
    template: ChatTemplate | None,
    tokenizer_files: tuple[dict, dict, dict, dict],
) -> None:
    """Write the model's ``config.json`` and its tokenizer's files (:func:`_tokenizer_files`)
    into ``folder``, with chat ``template`` when there is one."""
    tokenizer_json, tokenizer_config, generation_config, ids = tokenizer_files
    _write_json(
        folder / "config.json",
        hf.hf_config(
            args,
            dtype=dtype,
            bos_token_id=ids["bos_token_id"],
            eos_token_id=ids["eos_token_id"],
        ),
    )
    _write_json(folder / "generation_config.json", generation_config)
    if template is not None:  # both places transformers has read it from, older ones included
        tokenizer_config = {**tokenizer_config, "chat_template": template.source}
        (folder / "chat_template.jinja").write_text(template.source, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    _write_json(folder / "tokenizer.json", tokenizer_json)


def _own_template(tokenizer_path: Path) -> ChatTemplate | None:
    """The chat template of the tokenizer's folder, when it has its own (none is invented for
    a model that may never have seen one)."""
    template = ChatTemplate.for_tokenizer(tokenizer_path)
    return None if template.source == DEFAULT_CHAT_TEMPLATE else template


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        _write(f, json.dumps(value, indent=2, ensure_ascii=False) + "\n")
