"""The public plugin API: everything a plugin may import from the core.

A plugin imports from this module only (``from plugtrain.plugin import hookimpl, ...``); the
hooks themselves, with when each fires and what it may change, are declared and documented in
:mod:`plugtrain.hookspecs`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pluggy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from plugtrain import API_VERSION, PROJECT_NAME
from plugtrain.data import IGNORE_INDEX, MicroBatch, Rewind, SkipRange
from plugtrain.distributed import ParallelDims
from plugtrain.errors import ConfigError, PluginError, check_field
from plugtrain.evaluation import EncodedTasks, Score, Task, encode_tasks, read_task, score
from plugtrain.model import (
    AdapterExport,
    AdapterWriter,
    Conversion,
    ExportRule,
    MergeInto,
    ShardLike,
    Storage,
    Switch,
    TensorParallelStyle,
    TextTokenizer,
    complete,
    conversion_of,
    logsumexp,
    whole_logits,
)

if TYPE_CHECKING:
    from pathlib import Path

    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

    from plugtrain.config import JobConfig, OptimizerConfig
    from plugtrain.data import PackedDataset
    from plugtrain.model.moe.layer import RouterStats

__all__ = [
    "API_VERSION",
    "IGNORE_INDEX",
    "PROJECT_NAME",
    "AdapterExport",
    "AdapterWriter",
    "ConfigError",
    "ConvertContext",
    "EncodedTasks",
    "HfExporter",
    "LossContext",
    "MergeInto",
    "MicroBatch",
    "ModelContext",
    "OptimizerContext",
    "ParallelDims",
    "PluginError",
    "Rewind",
    "RunControl",
    "Score",
    "SetupContext",
    "ShardLike",
    "SkipRange",
    "StepContext",
    "StepLoss",
    "Storage",
    "Switch",
    "Task",
    "TextTokenizer",
    "ValidationContext",
    "additions_off",
    "check_field",
    "complete",
    "data_parallel_group",
    "encode_tasks",
    "full_tensor",
    "grouped_by_mesh",
    "hookimpl",
    "local_tensor",
    "read_task",
    "reduce_over_replicas",
    "reduce_over_stages",
    "refuse_split_model",
    "refuse_tensor_parallel",
    "score",
    "total_norm",
    "whole_logits",
    "wrap_forward",
]

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementation: ``@hookimpl`` or ``@hookimpl(tryfirst=True)``."""


def _sole_holder(holder: str | None, name: str, doing: str) -> str:
    """``name``, as the one plugin that does what ``doing`` says this run; a second is refused."""
    if holder is not None:
        raise PluginError(f"plugins '{holder}' and '{name}' both {doing}: enable only one of them")
    return name


@dataclass(eq=False)
class ConvertContext:
    """What ``convert_model`` receives: the model to convert, on the meta device, unsharded.

    A plugin adds parameters with :meth:`add_parameter` and freezes others with
    :meth:`freeze`, here only (a call after the hook is refused). It may wrap the forwards
    that use what it added (:func:`wrap_forward`). It never renames, replaces or removes a
    base parameter: checkpoints, the tensor-parallel plan and the Hugging Face names key on
    them.
    """

    config: JobConfig
    """The whole validated config (core sections and every enabled plugin's section)."""
    model: nn.Module
    """The :class:`~plugtrain.model.transformer.Transformer`, on the meta device, unsharded."""
    blocks: tuple[nn.Module, ...]
    """The transformer blocks, ``model.layers`` in order."""
    parallel_dims: ParallelDims
    """The job's parallel dimensions (:class:`ParallelDims`), as the model hooks get them; the
    parallelisation comes after this hook. ``plugtrain export-hf`` fires it again in one
    process (``ParallelDims()``): what a plugin adds must not depend on the degrees."""
    conversion: Conversion = field(repr=False)
    """The model's conversion record (``plugtrain.model.conversion``), which the core's
    initialisation, tensor parallelism, initial load and export consult."""
    name_of: Callable[[object], str] = field(repr=False)
    """The name a registered plugin object runs under (see :attr:`SetupContext.name_of`)."""

    def plugin_config(self, plugin: object) -> Any:
        """Return ``plugin``'s validated config section (its config dataclass)."""
        return self.config.plugin(self.name_of(plugin))

    def add_parameter(
        self,
        plugin: object,
        module: str,
        name: str,
        shape: tuple[int, ...],
        *,
        init: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
        tp: TensorParallelStyle,
        export: ExportRule,
    ) -> nn.Parameter:
        """Add a trainable float32 parameter ``name`` of ``shape`` to submodule ``module``
        (``"layers.0.attention.wq"``) and return it, with its rules:

        * ``init(t, generator)`` fills the float32 CPU tensor ``t`` from ``generator`` and
          returns it, as the model's own ``init_plan`` fills do; the generator is seeded from
          ``training.seed`` and the parameter's place after the model's own plan, in the
          order of the added names, so a run is reproducible whatever the plugins' order;
        * ``tp`` is how tensor parallelism places it: ``"replicate"``, ``ShardLike(base)``
          (with the placements of base parameter ``base``), ``ShardLike(base, dim=d)`` (split
          only where ``base`` splits dimension ``d``, which both share), or None, which
          refuses ``parallelism.tp`` above 1 in one line;
        * ``export`` is what the Hugging Face export does with it: ``"drop"`` it, or
          ``MergeInto(base, fn)``, which writes ``fn(base_weight, added)`` in place of base
          parameter ``base`` (``added`` maps every added parameter's full name to its full
          tensor), so that the exported folder is a plain Llama one.
        """
        return self.conversion.add(
            self.model, self.name_of(plugin), module, name, shape, init, tp, export
        )

    def set_adapter(self, plugin: object, writer: AdapterWriter) -> None:
        """Make ``plugin`` the writer of the run's adapter: ``plugtrain export-hf --adapter``
        calls ``writer(export)`` (an :class:`AdapterExport`: a folder to fill, the added
        parameters' full tensors, the Hugging Face names of the base parameters) to write the
        added parameters alone, in the plugin's format (lora: a peft folder). One plugin per
        run; a run where none sets one refuses ``--adapter`` in one line."""
        self.conversion.set_adapter(self.name_of(plugin), writer)

    def set_switch(self, plugin: object, switch: Switch) -> None:
        """Let ``switch`` turn what ``plugin`` added off: ``switch(False)`` makes the model
        compute as if the plugin had added nothing (lora: each adapted projection skips its
        adapter), ``switch(True)`` undoes it. It must change no parameter and allocate
        nothing, and hold under FSDP2 and the other model hooks (a flag the forwards read).
        :func:`additions_off` flips every plugin's switch: the base model without a second
        copy (dpo's ``reference = "adapters_off"``)."""
        self.conversion.set_switch(self.name_of(plugin), switch)

    def freeze(
        self, plugin: object, *names: str, saved: bool = True, storage: Storage | None = None
    ) -> None:
        """Freeze the parameters ``names`` (full names): no gradient, no optimizer state; a
        checkpoint still saves and restores them, bit for bit. ``saved=False`` leaves them
        out of the checkpoints of a run that starts from ``checkpoint.initial_load_path``
        (lora's base): resuming, ``export-hf`` and ``generate`` re-read them from it, once
        its files' sha256 is checked against the one each checkpoint records. ``storage``
        (a :class:`Storage`) holds them in its own form rather than in float32 (lora's NF4
        base): they are then never saved, and a run that saves checkpoints needs
        ``checkpoint.initial_load_path`` to read them back from."""
        self.conversion.freeze(self.model, self.name_of(plugin), names, saved, storage)


@dataclass(eq=False)
class ModelContext:
    """What the model hooks (``wrap_model``, ``compile_model``) receive: the model before sharding.

    The model is on the meta device (no storage yet) and not yet sharded with FSDP2; its
    parameters are materialised and initialised after the hooks. The fields say what the run
    will do with it, so that a transform can fit the device and dtypes.
    """

    config: JobConfig
    """The whole validated config (core sections and every enabled plugin's section)."""
    model: nn.Module
    """The family's model (Llama's :class:`~plugtrain.model.llama.transformer.Transformer`), on
    the meta device, unsharded."""
    blocks: tuple[nn.Module, ...]
    """The transformer blocks, ``model.layers`` in order: each is sharded on its own (FSDP2)."""
    norm: nn.Module
    """The final RMSNorm, ``model.norm``, between the last block and the output projection."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """The loss of a training microbatch from its logits and targets: the mean fp32
    cross-entropy, or for data with a loss mask (chat data) its sum over the targets that
    count, which the trainer divides by the step's count (``training/loss.py``). A
    compiler may replace it, in ``compile_model`` only, by a compiled version of itself
    (``ctx.loss_fn = torch.compile(ctx.loss_fn)``); the trainer calls what it holds after the
    model hooks, at every microbatch. Validation keeps the plain cross-entropy."""
    device: torch.device
    """The device the model will be materialised on and trained on."""
    param_dtype: torch.dtype
    """Dtype of parameters in forward and backward (``training.mixed_precision_param``)."""
    reduce_dtype: torch.dtype
    """Dtype of the gradient reduction (``training.mixed_precision_reduce``)."""
    parallel_dims: ParallelDims
    """The job's parallel dimensions (:class:`ParallelDims`): each degree, this rank's index
    in it and its mesh, by name; the world rank and size; the data-parallel rank and size."""
    name_of: Callable[[object], str] = field(repr=False)
    """The name a registered plugin object runs under (see :attr:`SetupContext.name_of`)."""
    compiler: str | None = None
    """The plugin that declared, with :meth:`register_compiler`, that it compiles the model."""

    def plugin_config(self, plugin: object) -> Any:
        """Return ``plugin``'s validated config section (its config dataclass)."""
        return self.config.plugin(self.name_of(plugin))

    def register_compiler(self, plugin: object) -> None:
        """Declare that ``plugin`` compiles the model in ``compile_model`` this run.

        Two compilers do not commute (each would compile the other's output, or replace it):
        the second to declare itself is refused, naming both.
        """
        self.compiler = _sole_holder(self.compiler, self.name_of(plugin), "compile the model")


def additions_off(model: nn.Module) -> contextlib.AbstractContextManager[None] | None:
    """A reusable context in which the run's ``model`` computes as the base model: every
    plugin that added parameters in ``convert_model`` has them switched off (its
    :meth:`ConvertContext.set_switch`), on again on exit. None when no plugin of the run
    registered a switch, for the caller to refuse in its own words; a plugin that added
    parameters without a switch is refused in one line. Nothing is copied or allocated: use it
    around a no-grad forward of the policy as its own reference."""
    return conversion_of(model).switched_off()


def wrap_forward(module: nn.Module, wrapper: Callable[[Callable[..., Any]], Any]) -> None:
    """Replace ``module.forward`` by ``wrapper(module.forward)``, in place.

    The module keeps its class, parameters and names, so state-dict keys and checkpoints are
    the same with and without the wrapper; hooks registered on the module (FSDP2's all-gather
    and reshard) run around the wrapped forward, outside it. Wrappers compose: the last one
    applied is the outermost.
    """
    module.forward = wrapper(module.forward)


class HfExporter(Protocol):
    """What :attr:`SetupContext.export_hf` is: the writer of ``plugtrain export-hf``."""

    def __call__(
        self,
        checkpoint: Path,
        out: Path,
        *,
        dtype: torch.dtype | None = ...,
        weights: str = ...,
        max_shard_size: int = ...,
        overwrite: bool = ...,
    ) -> object:
        """Write complete checkpoint folder ``checkpoint`` as the Hugging Face Llama folder
        ``out``, as ``plugtrain export-hf`` does (the same bytes): ``weights`` is ``"model"``
        or ``"ema"`` (the ema plugin's average), every floating tensor is cast to ``dtype``
        (default None: kept in the checkpoint's, float32), files above ``max_shard_size``
        bytes (default 5e9) are split. Reads one tensor at a time in this process, with no
        collective: call it on one rank. Bad input raises a one-line ``UserError``."""


@dataclass(eq=False)
class OptimizerContext:
    """What ``build_optimizer`` receives: the sharded model's parameters, by name.

    The model is sharded and materialised (its weights initialised or loaded); nothing has
    stepped. The optimizer a plugin builds from these parameters is the run's only one.
    """

    config: JobConfig
    """The whole validated config (core sections and every enabled plugin's section)."""
    named_parameters: tuple[tuple[str, nn.Parameter], ...]
    """Every trainable parameter (not those frozen in ``convert_model``) with its name
    (``layers.0.attention.wq.weight``), in ``model.named_parameters()`` order: FSDP2
    DTensors, each ``Shard(0)`` over the mesh's ``dp_shard`` dimension (replicated over
    ``dp_replicate``); plain tensors in a float32 run of one process. ``p.shape`` is the full
    (logical) shape either way."""
    optimizer_config: OptimizerConfig
    """The core's ``[optimizer]`` section (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``no_decay``): settings a plugin may reuse for the parameters it trains with AdamW."""
    device: torch.device
    parallel_dims: ParallelDims
    """The job's parallel dimensions (:class:`ParallelDims`): each degree, this rank's index
    in it and its mesh, by name; the world rank and size; the data-parallel rank and size."""
    name_of: Callable[[object], str] = field(repr=False)
    """The name a registered plugin object runs under (see :attr:`SetupContext.name_of`)."""

    def plugin_config(self, plugin: object) -> Any:
        """Return ``plugin``'s validated config section (its config dataclass)."""
        return self.config.plugin(self.name_of(plugin))

    def learning_rate(self, value: float) -> torch.Tensor:
        """A param group's ``lr`` as the LR schedule needs it: a 0-d float32 tensor on the
        device holding the peak ``value``, which the schedule scales in place each step."""
        return torch.tensor(value, dtype=torch.float32, device=self.device)


@dataclass(eq=False)
class SetupContext:
    """What the ``setup`` hook receives: the run as built, before its first step.

    Plugins read the resolved mixed-precision dtypes here rather than from FSDP internals or
    the raw config strings.
    """

    config: JobConfig
    """The whole validated config (core sections and every enabled plugin's section)."""
    model: nn.Module
    """The model, wrapped with FSDP2 ``fully_shard``: its parameters are DTensors. A float32 run
    of one process has nothing to shard or cast and is not wrapped: plain tensors (use
    :func:`local_tensor` and :func:`full_tensor` to handle both)."""
    optimizer: Optimizer
    lr_scheduler: LRScheduler
    param_dtype: torch.dtype
    """Dtype of parameters in forward and backward (``training.mixed_precision_param``)."""
    reduce_dtype: torch.dtype
    """Dtype of the gradient reduce-scatter (``training.mixed_precision_reduce``)."""
    device: torch.device
    parallel_dims: ParallelDims
    """The job's parallel dimensions (:class:`ParallelDims`). Its data-parallel mesh,
    ``get_mesh("dp")``, is 1-D, ``("dp_shard",)``, under FSDP; 2-D, ``("dp_replicate",
    "dp_shard")``, under hybrid sharding (HSDP), where each parameter is sharded within a row and
    the rows hold equal copies. Every rank of it trains on its own data: reduce a value computed
    from the data (a loss) over :func:`data_parallel_group`; a value of the gradients or
    parameters with DTensor ops (:func:`total_norm`), which reduce over the shards only, not over
    the replicas' equal copies. Under tensor parallelism (``tp_enabled``) the ranks of a ``tp``
    group train on the same data: ``dp_rank`` and ``dp_size`` count the data-parallel ranks, and
    the parameters' own meshes add a ``"tp"`` dimension."""
    name_of: Callable[[object], str] = field(repr=False)
    """The name a registered plugin object runs under: its entry point's name, which is also
    its config section and its metrics' prefix."""
    export_hf: HfExporter = field(repr=False)
    """Writes a saved checkpoint as a Hugging Face folder (:class:`HfExporter`): handed in by
    the trainer, as the plugin API sits below the checkpoint code."""
    loss_scaler: str | None = None
    """The plugin that declared, with :meth:`register_loss_scaler`, that it scales the loss."""
    deactivations: dict[object, str] = field(default_factory=dict, repr=False)
    """Plugins that called :meth:`deactivate`, with their reasons (the host reads it)."""
    control: RunControl = field(default_factory=lambda: RunControl(), repr=False)
    """The run's :class:`RunControl`: the batch ranges skipped so far; skips and rewinds to ask
    for. The same object step hooks see as :attr:`StepContext.control`."""
    console: dict[str, bool] = field(default_factory=dict, repr=False)
    """The plugin metrics the console line shows, by full key, as :meth:`show_on_console`
    declared them (the trainer reads it)."""
    tokenizer: TextTokenizer | None = None
    """The run's tokenizer (``encode``, ``decode``, ``bos_id``, ``eos_id``): what a plugin that
    writes text with :func:`complete` encodes its prompts with. None in unit-test contexts."""
    data_kind: str = "text"
    """What the run trains on: ``text``, ``chat`` or ``preference`` (pairs of a chosen and a
    rejected completion, ``plugtrain.data.preference``, which a loss plugin such as ``dpo``
    trains on)."""
    build_like: Callable[[], nn.Module] | None = field(default=None, repr=False)
    """Builds a model laid out like the run's (family, shape, tensor-parallel split, FSDP2
    sharding, mixed precision), without the model hooks, its weights empty: what
    :meth:`frozen_copy` fills. None in unit-test contexts."""
    datasets: tuple[PackedDataset, ...] = ()
    """The datasets the run reads, each a prepared folder's samples: the training data's (each
    source of ``data.sources`` in order), then the validation data's if the run validates.
    A plugin reads them whole here if it needs to (dpo's precomputed reference); the training
    and validation batches draw from them (see :meth:`number_samples`)."""

    @property
    def resuming(self) -> bool:
        """Whether the run resumes from a checkpoint of its ``job.dump_folder`` after
        ``setup`` (its ``load_state_dict`` then fires): the model holds the seeded init now,
        not the weights the run started from."""
        from plugtrain.checkpoint import initial_load_ignored

        return bool(initial_load_ignored(self.config.checkpoint, self.config.job.dump_folder))

    def number_samples(self) -> tuple[PackedDataset, ...]:
        """Make every training and validation microbatch carry ``samples``, each row's number
        in the run's numbering: :attr:`datasets` in order, sample ``i`` of one numbered
        ``first_sample + i``. The same sample has the same number in every epoch, on every
        rank and after a resume. Returns :attr:`datasets`. Runs that never call it carry
        none and pay nothing."""
        first = 0
        for dataset in self.datasets:
            dataset.first_sample, first = first, first + len(dataset)
        return self.datasets

    def frozen_copy(self) -> nn.Module:
        """A frozen copy of the model as it is now: in ``setup``, the run's starting weights
        (initialised, or the initial load). A resumed run loads its checkpoint after ``setup``
        and skips the initial load, so its copy is of the seeded init: a plugin whose copy
        must outlive a resume saves it in its ``state_dict`` (dpo does). Built by
        :attr:`build_like`, each parameter shard copied from the model's (the parameters
        ``convert_model`` added are not there), ``requires_grad`` False: run it under
        ``torch.no_grad``. Under FSDP2 each of its forwards ends resharded: FSDP2 would keep
        the root's and the last block's parameters gathered for a backward that never comes
        (about 2 GB a GPU for an 8B model's embedding and output)."""
        if self.build_like is None:
            raise PluginError(
                "this setup context builds no model (a unit test's): take the frozen copy in a "
                "real run's setup (plugtrain.testing.make_trainer)"
            )
        copy = self.build_like()
        theirs = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in copy.named_parameters():
                param.copy_(theirs[name])
        groups = [m for m in copy.modules() if isinstance(m, FSDPModule)]

        def reshard(*_: object) -> None:
            for group in groups:
                group.reshard()

        if groups:
            copy.register_forward_hook(reshard)
        return copy.requires_grad_(False).eval()

    def plugin_config(self, plugin: object) -> Any:
        """Return ``plugin``'s validated config section (its config dataclass)."""
        return self.config.plugin(self.name_of(plugin))

    def show_on_console(self, plugin: object, *keys: str, nonzero: bool = False) -> None:
        """Show ``plugin``'s metrics ``keys`` on the console line, as ``<name>/<key>``.

        A key is one the plugin reports: a ``step_metrics`` key, a ``loss_terms`` name, or
        ``validation_loss`` for the weights it offers in ``validation_weights``. Every metric
        goes to ``metrics.jsonl`` and the other sinks whatever this says; the console shows a
        plugin's metrics only when it asks here, so that its line stays short (about 160
        characters with every shipped plugin): show the value a user watches (grad_clip its
        ``grad_norm``), not internals. ``nonzero`` shows them only while they are not zero:
        counts of rare events (spike_guard's rewinds).
        """
        name = self.name_of(plugin)
        self.console.update({f"{name}/{key}": nonzero for key in keys})

    def deactivate(self, plugin: object, reason: str) -> None:
        """Unregister ``plugin`` once ``setup`` returns, so that none of its hooks fire again.

        A plugin with nothing to do in this run (the loss scaler under bf16) calls this to
        cost exactly nothing: it is not called on the hot path, and it saves no state. The
        reason appears in the start-up "plugins:" line and in ``run.json``.
        """
        self.deactivations[plugin] = reason

    def register_loss_scaler(self, plugin: object) -> None:
        """Declare that ``plugin`` scales the loss in ``pre_backward`` this run.

        The trainer warns when float16 compute runs with no loss scaler, and refuses two: each
        would scale the loss and unscale the gradients on top of the other. Step hooks see the
        result as :attr:`StepContext.loss_scaler`.
        """
        self.loss_scaler = _sole_holder(self.loss_scaler, self.name_of(plugin), "scale the loss")


@dataclass(eq=False, slots=True)
class StepContext:
    """The mutable state of one optimizer step, handed to every step hook.

    One instance is built per optimizer step; the trainer sets the fields as the step proceeds.
    """

    step: int
    """The optimizer step being computed, 1-based (the first step is 1)."""
    num_microbatches: int
    """Microbatches accumulated into this step (``training.grad_accum_steps``)."""
    model: nn.Module
    optimizer: Optimizer
    params: tuple[nn.Parameter, ...]
    """The model's trainable parameters (those a plugin froze in ``convert_model`` are left
    out), in ``model.parameters()`` order (FSDP2 DTensors, sharded over
    the mesh; plain tensors in a float32 run of one process). A tuple the trainer builds once:
    walking the module tree costs 50 us (debug model) to 400 us (8B) per
    ``model.parameters()`` call."""
    loss_scaler: str | None = None
    """The plugin that scales the loss this run (see :meth:`SetupContext.register_loss_scaler`),
    or None: a plugin that handles non-finite gradients leaves them to it."""
    microbatch: int = 0
    """Index of the current microbatch, ``0 .. num_microbatches - 1``."""
    loss: torch.Tensor | None = None
    """In ``pre_backward``: the scalar tensor ``backward()`` will run on (already divided by
    ``num_microbatches``). A plugin may replace it (the loss scaler multiplies it). The loss the
    trainer logs is taken before the hook, so it is never affected."""
    skipped: torch.Tensor | None = None
    """In ``post_step``: whether a veto skipped the optimizer step, a 0-d bool tensor on the
    device (reading it on the host is a sync: use it in device arithmetic)."""
    skip_reasons: list[str] = field(default_factory=list)
    """In ``post_step``: the reasons of the string vetoes (device vetoes give none)."""
    batch: int = 0
    """The global number of the batch this step trains on: the batches the data stream has
    handed out since the run began, this one included (skipped ones count), the same on every
    rank and for any world size. Without skips it equals :attr:`step`."""
    control: RunControl = field(default_factory=lambda: RunControl())
    """The run's :class:`RunControl`, for requests decided on the host (skips, rewinds)."""

    def gradients(self) -> list[torch.Tensor]:
        """The ``.grad`` of every parameter that has one, in :attr:`params` order.

        Under FSDP2 these are DTensor shards; reduce over them with DTensor ops (or
        :func:`local_tensor` plus an explicit collective) to get global quantities. Under
        pipeline parallelism they are this rank's stages' only (none on a frozen stage): pass
        the job's dims to :func:`total_norm`, agree a flag with :func:`reduce_over_stages`.
        """
        return [p.grad for p in self.params if p.grad is not None]


class StepLoss(Protocol):
    """What ``build_loss`` returns: the loss of each microbatch, in place of the cross-entropy.

    The trainer normalises it by the step's count of *units* (what the loss is a mean over),
    counted once per step on the device over every microbatch and data-parallel rank (see
    ``hookspecs.build_loss``)."""

    def units(self, microbatch: MicroBatch) -> torch.Tensor:
        """How many units (pairs, sequences) ``microbatch`` holds: a 0-d tensor on the device."""
        ...

    def __call__(self, model: nn.Module, microbatch: MicroBatch, index: int) -> torch.Tensor:
        """``microbatch``'s loss summed over its units, 0-d, in the autograd graph (under
        ``torch.no_grad`` in validation): the plugin runs ``model``'s forward itself
        (``model(microbatch.inputs, **microbatch.model_inputs())``). ``index`` is the
        microbatch's in its step, or its batch's in a validation pass: 0 starts a new one (a
        plugin that sums metrics over a step or a pass starts them again)."""
        ...


@dataclass(eq=False)
class LossContext:
    """What ``loss_terms`` receives: one microbatch's output and targets (not the model)."""

    step: int
    """The optimizer step being computed, 1-based."""
    microbatch: int
    """Index of the microbatch, ``0 .. num_microbatches - 1``."""
    num_microbatches: int
    logits: torch.Tensor | None
    """The model's output, ``(batch, seq_len, vocab)`` in the compute dtype, in the autograd
    graph: a term computed from it is backpropagated. None with ``[model] loss_chunks`` > 1,
    where the full logits never exist: a term of the logits' normaliser reads :attr:`lse`."""
    targets: torch.Tensor
    """The next-token ids, ``(batch, seq_len)``."""
    mask: torch.Tensor
    """The targets that count, ``(batch, seq_len)`` bool: those that are not ``-100`` (with
    chat data the assistant's), every target of text."""
    count: torch.Tensor | float
    """The step's count, the cross-entropy's normaliser: the targets that count over every
    microbatch of the step and every data-parallel rank, divided by the number of those ranks
    (whose gradients FSDP2 averages). A float for text (``batch * seq_len`` over the ranks),
    a 0-d tensor with a loss mask. A term normalised as the cross-entropy is returns this
    microbatch's share of the step's term: its sum over :attr:`mask`'s targets over ``count``
    (summed over the microbatches, the step's mean over every counted target)."""
    precomputed_lse: torch.Tensor | None = field(default=None, repr=False)
    """:attr:`lse` as a chunked loss computed it beside the loss, chunk by chunk; None: the
    property computes it from :attr:`logits` on first use."""
    router: Sequence[RouterStats] = ()
    """Each mixture-of-experts layer's router statistics of this microbatch's forward, in block
    order (``model.moe.layer.RouterStats``: the router logits and probabilities, in the
    autograd graph, and the token copies per expert); empty for a model without experts. The
    input of a load-balancing or router loss (the core's own, ``[model] moe_aux_loss_weight``
    and ``moe_z_loss_weight``, are computed from it)."""

    @property
    def lse(self) -> torch.Tensor:
        """The log-sum-exp of the logits over the vocabulary, ``(batch, seq_len)``, in fp32.

        Computed on first use and shared by every plugin of the microbatch. The cross-entropy
        does not reuse it: rebuilding it from this would change the main loss's rounding.
        Always a plain tensor: under tensor parallelism the replicated value every rank holds
        (reduced over the vocabulary's shards, never gathered), so that it combines with
        :attr:`mask`."""
        if self.precomputed_lse is None:
            assert self.logits is not None
            self.precomputed_lse = local_tensor(logsumexp(self.logits.float()))
        return self.precomputed_lse


@dataclass(eq=False)
class ValidationContext:
    """What ``pre_validation``, ``validation_metrics`` and ``post_validation`` receive: one
    validation pass."""

    step: int
    """Optimizer steps completed when the validation runs."""
    weights: str | None = None
    """The weight set this pass evaluates: None for the model's own weights, else a name a
    plugin offered in ``validation_weights`` (that plugin swaps its weights in)."""
    loss: float | None = None
    """From ``validation_metrics`` on: the pass's mean loss, over the validation batches and
    ranks."""


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: ``full_tensor()`` of a DTensor (a collective), ``t`` itself otherwise."""
    gather = getattr(t, "full_tensor", None)
    return gather() if gather is not None else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of ``t``: ``to_local()`` of a DTensor, ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


MetricValue = float | int | torch.Tensor
"""A step metric: a Python number, or a 0-d tensor (read on logging steps only)."""
Metrics = Mapping[str, MetricValue]


def data_parallel_group(dims: ParallelDims) -> dist.ProcessGroup:
    """The process group of the data-parallel mesh of ``dims``, over every dimension: the ranks
    that train on different data, over which a value computed from the data (a loss) is
    reduced; its ``size()`` is ``dims.dp_size`` (under tensor parallelism, fewer than the world
    size: a ``tp`` group trains on the same data). Call it on every rank at once (in ``setup``):
    under HSDP its first call creates the group."""
    mesh = dims.get_mesh("dp")
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten("dp").get_group()


def reduce_over_replicas(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """All-reduce ``value`` in place with max over the mesh dimensions where DTensor ``like``
    is replicated (HSDP's ``dp_replicate``, tensor parallelism's ``tp`` for a norm's weight);
    return it. A no-op for a plain tensor ``like`` and under FSDP (no such dimension): no
    collective.

    DTensor ops reduce a gradient's values over its shards only, since the replicas hold equal
    copies after FSDP2's all-reduce. A flag every rank must act on together (skip the step) is
    made the same everywhere with this, even if one replica's gradients were changed after
    that all-reduce.
    """
    placements = getattr(like, "placements", ())
    for dim, placement in enumerate(placements):
        group = like.device_mesh.get_group(dim)  # type: ignore[attr-defined]
        if placement.is_replicate() and group.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def refuse_tensor_parallel(dims: ParallelDims, name: str) -> None:
    """Refuse, in one line, to run plugin ``name`` under tensor parallelism (``dims.tp > 1``):
    for a plugin that does not handle it yet. Call it where the plugin first sees the context
    (``setup``, or a model hook: ``ctx.parallel_dims``), so the run stops before step 1."""
    tp = dims.tp
    if tp > 1:
        raise ConfigError(
            f"plugin '{name}' does not run under tensor parallelism yet (parallelism.tp = {tp}): "
            f"remove '{name}' from plugins.enabled, or set parallelism.tp = 1"
        )


def refuse_split_model(dims: ParallelDims, name: str) -> None:
    """Refuse, in one line, to run plugin ``name`` where no rank holds the whole model's
    forward: under pipeline parallelism (``dims.pp > 1``, each rank holds its stages) or
    context parallelism (``dims.cp > 1``, each rank its part of every sequence); for a plugin
    that runs the whole model itself (decoding, scoring). Call it in ``setup``, so the run
    stops before step 1."""
    holds = {
        "pp": "pipeline parallelism (parallelism.pp = {}) each rank holds only its stages",
        "cp": "context parallelism (parallelism.cp = {}) each rank holds its part of each row",
    }
    for key, degree in (("pp", dims.pp), ("cp", dims.cp)):
        if degree > 1:
            raise ConfigError(
                f"plugin '{name}' runs the whole model, but under {holds[key].format(degree)}: "
                f"remove '{name}' from plugins.enabled, or set parallelism.{key} = 1"
            )


def reduce_over_stages(
    value: torch.Tensor, dims: ParallelDims, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX
) -> torch.Tensor:
    """All-reduce ``value`` in place over the pipeline stages of ``dims`` (its ``"pp"``
    mesh dimension), with ``op`` (default max: a flag every stage acts on together); return
    it. A no-op without pipeline parallelism (``dims.pp`` 1): no collective.

    Under pipeline parallelism each rank holds its stages' parameters and gradients only, and
    the loss exists on the last stage only: a value every rank must share (a skip flag, the
    step's loss) is made the same on every stage with this. A max may drop a nan (NCCL's, and
    gloo's when another rank's value comes first): reduce a flag with it, a value that may be
    nan with ``dist.ReduceOp.SUM`` (the others adding 0).
    """
    if dims.pp_enabled:
        assert dims.root is not None, "a pipeline runs on a mesh"
        dist.all_reduce(value, op=op, group=dims.root.get_group("pp"))
    return value


def total_norm(
    tensors: list[torch.Tensor], norm_type: float = 2.0, *, dims: ParallelDims | None = None
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``tensors`` together, over every rank and FSDP2 shard.

    A 0-d fp32 tensor on the device, the same on every rank, as ``clip_grad_norm_`` computes it
    on the unsharded model; inf or nan if any element is. Nothing is read on the host. Under
    HSDP it is computed over the shards of one replica, then made the same on every replica
    (:func:`reduce_over_replicas`: a no-op when their gradients are equal, as they are). Under
    expert parallelism the experts' norm (over their mesh) and the rest's are combined, each
    counted once (Automodel #3816: a norm per EP group; SpecForge #882: replicas summed).

    ``dims`` (the job's :class:`ParallelDims`) is needed under pipeline parallelism, where
    each rank's ``tensors`` are its stages' share only: the stages' norms are combined into the
    whole model's (one all-reduce over ``"pp"``; none without a pipeline), a rank with no
    tensors at all (a frozen stage) joining with 0. Pass it always: the same call is then
    right for every layout.
    """
    norm = _norm_over_meshes(tensors, norm_type)
    if dims is None or not dims.pp_enabled:
        return norm
    norm = norm.to(dims.device, torch.float32)
    if norm_type == math.inf:
        # Max, with a nan carried apart: a max reduction may drop it.
        both = torch.stack([norm.nan_to_num(nan=0.0, posinf=math.inf), norm.isnan().float()])
        reduce_over_stages(both, dims)
        return torch.where(both[1] > 0, math.nan, both[0])
    # A sum of the stages' norm ** p carries inf and nan as they are.
    return reduce_over_stages(norm.pow(norm_type), dims, dist.ReduceOp.SUM).pow(1 / norm_type)


def _norm_over_meshes(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """:func:`total_norm` of ``tensors`` over their own meshes (this pipeline stage's)."""
    if not tensors:
        return full_tensor(torch.nn.utils.get_total_norm(tensors, norm_type, foreach=True))
    norms = []
    for group in grouped_by_mesh(tensors):
        # On DTensor gradients the norm is a DTensor that may still be partial over ranks
        # (Partial(max) for inf): full_tensor() all-reduces it into the global norm.
        norm = full_tensor(torch.nn.utils.get_total_norm(group, norm_type, foreach=True))
        norms.append(reduce_over_replicas(norm, group[0]))
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)


def grouped_by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by the device mesh they are DTensors over (plain tensors together),
    in the order first met: one group but under expert parallelism, whose experts have a mesh
    of their own. DTensor ops over several tensors (a norm, a foreach kernel) need one mesh."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


# --------------------------------------------------------------------------- run control


class RunControl:
    """Requests that a plugin makes of the run, decided on the host: skip data, rewind, stop.

    All three take effect at the end of the step that asks (after its checkpoint, if one is due),
    identically on every rank: a plugin must decide them from values that are the same on
    every rank and read on the same step (on logging steps, for instance), never from a
    per-step host read. Skipped batch ranges are the run's state: written atomically to
    ``<job.dump_folder>/data_skips.json`` before they apply, and kept in every later
    checkpoint, so that a restart, and a rewind to a checkpoint older than a range, still skip
    them. Batches are numbered globally (:attr:`StepContext.batch`), whatever the world size.
    """

    def __init__(self) -> None:
        self.skip_ranges: list[SkipRange] = []
        """Every range the run skips: read from ``data_skips.json`` and the checkpoint at
        start-up, and added by requests since."""
        self.rewinds: list[Rewind] = []
        """The rewinds done by this process, in order, as done."""
        self.requested_skips: list[SkipRange] = []
        self.requested_rewind: Rewind | None = None
        self.requested_stop: str | None = None
        """Why a plugin asked the run to stop after this step (None: it did not)."""

    def skip_batches(self, first: int, last: int, source: str, reason: str) -> None:
        """Skip global batches ``first`` .. ``last`` (those not drawn yet) from the next step on.

        ``source`` is the asking plugin's name. The batch the next step trains on has
        already been drawn and copied ahead: it is skipped too if it is in the range.
        """
        if not 1 <= first <= last:
            raise PluginError(f"plugin '{source}': skip_batches({first}, {last}) is no range")
        self.requested_skips.append(SkipRange(first, last, source, reason))

    def stop(self, source: str, reason: str) -> None:
        """End the run cleanly after this step, as a SIGTERM does: a checkpoint is saved (when
        checkpointing is on) and the run exits 0; the same command resumes it. A plugin that
        must end the run with an error raises :class:`PluginError` instead."""
        if self.requested_stop is None:
            self.requested_stop = f"the request of plugin '{source}': {reason}"

    def rewind(self, step: int, to_step: int, through_batch: int, source: str, reason: str) -> None:
        """After this ``step``, go back to the latest checkpoint at ``to_step`` or earlier and
        skip the batches from there through global batch ``through_batch``.

        The model, optimizer, schedule, data position, RNGs and plugin states are those of the
        checkpoint (``load_state_dict`` fires again); later checkpoints are deleted; the skipped
        range is kept as :meth:`skip_batches` says. A rewind that finds no checkpoint ends the
        run with a one-line :class:`CheckpointError`. One rewind per step: a second is an error.
        """
        if self.requested_rewind is not None:
            raise PluginError(
                f"plugin '{source}' asks for a rewind at step {step}, but "
                f"'{self.requested_rewind.source}' already did: one rewind per step, so ask "
                "at a later step"
            )
        self.requested_rewind = Rewind(step, to_step, through_batch, source, reason)
