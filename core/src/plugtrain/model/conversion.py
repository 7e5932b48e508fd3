"""The model's conversion record: the parameters plugins add, their rules, and those they freeze.

Plugins convert the model in the ``convert_model`` hook, on the meta device, before anything
else sees it (:class:`plugtrain.plugin.ConvertContext` calls :meth:`Conversion.add` and
:meth:`Conversion.freeze`). The record stays on the model (:func:`conversion_of`) and each part
of the core that handles parameters by name consults it, with no other knowledge of plugins:

* the initialisation: :meth:`Conversion.init_plan` follows the model's own ``init_plan``, so
  the base weights are drawn exactly as without the plugin and each added one from its own
  seeded generator (in the order of the names, whatever order the plugins registered in);
* tensor parallelism: :meth:`Conversion.tensor_parallel` keeps the added parameters out of the
  model's plan by names and places each by its style (replicated, or sharded like a base);
* the initial load reads the base weights only (:meth:`Conversion.base_state`): the added ones
  keep their init;
* the Hugging Face export applies the export rules (:meth:`Conversion.exported`): each added
  tensor is merged into a base weight or dropped, so the folder is a plain Llama one; or,
  with ``--adapter``, the plugin that set an adapter writer (:meth:`Conversion.set_adapter`)
  writes the added tensors alone, in its own format;
* a plugin that can switch what it added off registers how (:meth:`Conversion.set_switch`):
  :meth:`Conversion.switched_off` then runs the model as the base model (dpo's
  ``adapters_off`` reference), with no second model;
* a frozen parameter may be held in another form than float32 (a :class:`Storage`: QLoRA's
  NF4): it takes that form on the meta device before FSDP2 shards it
  (:meth:`Conversion.store_meta`), and its weights, initialised or loaded, are converted
  whole, then sharded (:meth:`Conversion.load_stored`). It is never saved in a checkpoint.

Base parameters are never renamed or removed: a checkpoint of a converted run holds every key
of a plain run's, plus the added ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from plugtrain.errors import PluginError
from plugtrain.model.init import Fill

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AdapterExport",
    "AdapterWriter",
    "AddedParameter",
    "Conversion",
    "ExportRule",
    "LazyTensors",
    "MergeInto",
    "ShardLike",
    "Storage",
    "Switch",
    "TensorParallelStyle",
    "conversion_of",
]

_ATTRIBUTE = "_plugtrain_conversion"
"""The model attribute that holds its :class:`Conversion` (FSDP2 keeps instance attributes)."""


@dataclass(frozen=True)
class ShardLike:
    """Tensor-parallel style: placed as base parameter ``base`` is (its placements over the
    ``tp`` mesh), e.g. LoRA's B of a column-wise ``wq`` (``Shard(0)``, the output rows) or its
    A of a row-wise ``wo`` (``Shard(1)``, the input columns).

    With ``dim``, only a split of that dimension is copied and the parameter is replicated
    otherwise: the parameter shares that one dimension with the base (LoRA's A shares the
    input columns, ``dim=1``; its B the output rows, ``dim=0``), so its placement follows the
    family's plan for the base, column-wise or row-wise, without the plugin knowing which."""

    base: str
    dim: int | None = None

    def placements(self, like: Any) -> tuple[Placement, ...]:
        """The placements for a parameter shaped like this, where the base is ``like``."""
        if not isinstance(like, DTensor):
            return (Replicate(),)
        if self.dim is None:
            return tuple(like.placements)
        return tuple(
            p if isinstance(p, Shard) and p.dim == self.dim else Replicate()
            for p in like.placements
        )


@dataclass(frozen=True)
class MergeInto:
    """Export rule: at export, base weight ``into`` becomes ``fn(weight, added)``, where
    ``added`` maps the full name of every added parameter to its full tensor (read on first
    access). The added parameter itself is not written."""

    into: str
    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class AdapterExport:
    """What an adapter writer (:meth:`Conversion.set_adapter`) gets from ``plugtrain export-hf
    --adapter``: everything to write a folder of the added parameters alone, for a client that
    applies them to the base model (peft)."""

    folder: Path
    """Where to write the files (the export renames it to the folder asked for once the
    writer returns; it is removed if the writer raises)."""
    tensors: Mapping[str, torch.Tensor]
    """Every added parameter's full tensor by full name, in the checkpoint's dtype, read on
    first access."""
    to_hf: Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]
    """``to_hf(base_name, tensor)``: the Hugging Face name of base parameter ``base_name``
    and ``tensor`` with its rows laid out as that format lays the parameter's (Llama's q and k
    rows permuted for RoPE): for a tensor whose rows are the parameter's output rows."""
    base_model: str
    """Where the run's base came from (its ``checkpoint.initial_load_path``), "" if nowhere."""
    dtype: torch.dtype
    """The dtype to write floating tensors in."""


@dataclass(frozen=True)
class Storage:
    """How a frozen parameter is held in memory, other than in float32 (QLoRA's NF4 base).

    ``store`` gets the parameter's full float32 tensor, on the meta device when the model is
    built and on the run's device once its weights are read, and returns what the model holds:
    a tensor (subclass) of that shape that FSDP2 can split along dimension 0 into equal parts
    (torchao's ``NF4Tensor`` can) and that ``F.linear`` computes with. Converting the whole
    tensor before splitting it gives every world size the same values. Tensor parallelism
    does not split it: the plugin refuses ``parallelism.tp`` above 1."""

    name: str
    """What it is called in messages and in the memory estimate (``nf4``)."""
    store: Callable[[torch.Tensor], torch.Tensor]
    nbytes: Callable[[tuple[int, ...]], int]
    """The bytes the stored form of a full tensor of that shape takes (the memory estimate)."""


AdapterWriter = Callable[[AdapterExport], None]
"""A plugin's writer of its adapter folder, for ``plugtrain export-hf --adapter``."""

Switch = Callable[[bool], None]
"""A plugin's switch of what it added: ``switch(False)`` makes the model compute as if the
plugin had added nothing, ``switch(True)`` undoes it."""

TensorParallelStyle = Literal["replicate"] | ShardLike | None
"""How an added parameter is placed under tensor parallelism; None refuses ``parallelism.tp``
above 1."""
ExportRule = Literal["drop"] | MergeInto
"""What the Hugging Face export does with an added parameter: drop it, or merge it."""


@dataclass(frozen=True)
class AddedParameter:
    """One parameter a plugin added, with its rules."""

    name: str
    """Its full name in the model (``layers.0.attention.wq.lora_a``)."""
    plugin: str
    init: Fill
    tp: TensorParallelStyle
    export: ExportRule


@dataclass
class Conversion:
    """What the plugins did to the model in ``convert_model`` (see the module docstring)."""

    added: dict[str, AddedParameter] = field(default_factory=dict)
    frozen: dict[str, str] = field(default_factory=dict)
    """Each frozen parameter's name, with the plugin that froze it."""
    unsaved: set[str] = field(default_factory=set)
    """Frozen parameters that the checkpoints of a run with ``checkpoint.initial_load_path``
    leave out: they are re-read from it (``plugtrain.checkpoint.base``)."""
    stored: dict[str, Storage] = field(default_factory=dict)
    """Frozen parameters held in another form than float32, by name (all of them unsaved)."""
    adapter: tuple[str, AdapterWriter] | None = None
    """The plugin that writes the added parameters as an adapter folder, and its writer."""
    switches: dict[str, Switch] = field(default_factory=dict)
    """Each plugin that can switch what it added off, with its switch."""
    open: bool = False
    """Whether ``convert_model`` is firing: additions and freezes are refused otherwise."""

    def _check_open(self, plugin: str, doing: str) -> None:
        if not self.open:
            raise PluginError(
                f"plugin '{plugin}' calls ctx.{doing} outside convert_model: add and freeze "
                "parameters in the convert_model hook only"
            )

    def add(
        self,
        model: nn.Module,
        plugin: str,
        module: str,
        name: str,
        shape: tuple[int, ...],
        init: Fill,
        tp: TensorParallelStyle,
        export: ExportRule,
    ) -> nn.Parameter:
        """Register a new float32 parameter ``name`` on submodule ``module`` of ``model`` (on
        the meta device) with its rules; every mistake is a one-line :class:`PluginError`."""
        self._check_open(plugin, "add_parameter")
        full = f"{module}.{name}" if module else name
        try:
            owner = model.get_submodule(module)
        except AttributeError:
            raise PluginError(
                f"plugin '{plugin}' adds '{full}' to module '{module}', which the model has "
                "not: name a module of model.named_modules()"
            ) from None
        if "." in name or not name or hasattr(owner, name):
            raise PluginError(
                f"plugin '{plugin}' adds '{full}', whose name is taken or not a plain "
                "attribute name: choose a new name (base parameters are never replaced)"
            )
        base = dict(model.named_parameters())
        if isinstance(export, MergeInto):
            if export.into not in base or export.into in self.added:
                raise PluginError(
                    f"plugin '{plugin}' merges '{full}' into '{export.into}', which is no base "
                    "parameter of the model: name one of model.named_parameters()"
                )
        elif export != "drop":
            raise PluginError(
                f"plugin '{plugin}' gives '{full}' the export rule {export!r}: give 'drop' or "
                "MergeInto(base_name, fn)"
            )
        if isinstance(tp, ShardLike) and (tp.base not in base or tp.base in self.added):
            raise PluginError(
                f"plugin '{plugin}' shards '{full}' like '{tp.base}', which is no base "
                "parameter of the model: name one of model.named_parameters()"
            )
        if isinstance(tp, ShardLike) and tp.dim is not None:
            base_shape = tuple(base[tp.base].shape)
            if not (0 <= tp.dim < min(len(shape), len(base_shape))) or (
                shape[tp.dim] != base_shape[tp.dim]
            ):
                raise PluginError(
                    f"plugin '{plugin}' shards '{full}' of shape {tuple(shape)} like "
                    f"'{tp.base}' of shape {base_shape} along dimension {tp.dim}, which they do "
                    "not share: give the dimension both have with the same size"
                )
        if tp not in (None, "replicate") and not isinstance(tp, ShardLike):
            raise PluginError(
                f"plugin '{plugin}' gives '{full}' the tensor-parallel style {tp!r}: give "
                "'replicate', ShardLike(base_name) or None"
            )
        param = nn.Parameter(torch.empty(shape, dtype=torch.float32, device="meta"))
        owner.register_parameter(name, param)
        self.added[full] = AddedParameter(full, plugin, init, tp, export)
        return param

    def freeze(
        self,
        model: nn.Module,
        plugin: str,
        names: tuple[str, ...],
        saved: bool = True,
        storage: Storage | None = None,
    ) -> None:
        """Set ``requires_grad`` False on the parameters ``names`` of ``model``; ``saved``
        False leaves them out of the checkpoints of a run with an initial load
        (:attr:`unsaved`); ``storage`` holds them in its form (:attr:`stored`), never saved."""
        self._check_open(plugin, "freeze")
        params = dict(model.named_parameters())
        for name in names:
            if name not in params:
                raise PluginError(
                    f"plugin '{plugin}' freezes '{name}', which the model has not: name one "
                    "of model.named_parameters()"
                )
            params[name].requires_grad_(False)
            self.frozen[name] = plugin
            if not saved or storage is not None:
                self.unsaved.add(name)
            if storage is not None:
                self.stored[name] = storage

    def set_adapter(self, plugin: str, writer: AdapterWriter) -> None:
        """Let ``writer`` write the run's adapter (``plugtrain export-hf --adapter``); one
        plugin per run."""
        self._check_open(plugin, "set_adapter")
        if self.adapter is not None and self.adapter[0] != plugin:
            raise PluginError(
                f"plugins '{self.adapter[0]}' and '{plugin}' both write the run's adapter: "
                "enable one of them"
            )
        self.adapter = (plugin, writer)

    def set_switch(self, plugin: str, switch: Switch) -> None:
        """Let ``switch`` turn what ``plugin`` added off and on again (:meth:`switched_off`)."""
        self._check_open(plugin, "set_switch")
        self.switches[plugin] = switch

    def switched_off(self) -> contextlib.AbstractContextManager[None] | None:
        """A reusable context in which the model computes as the base model, every plugin's
        additions switched off, then on again; None when no plugin registered a switch. A
        plugin that added parameters and registered no switch is refused in one line: the
        model would not be the base model."""
        if not self.switches:
            return None
        for added in self.added.values():
            if added.plugin not in self.switches:
                raise PluginError(
                    f"plugin '{added.plugin}' adds '{added.name}' but cannot switch it off "
                    "(ctx.set_switch in convert_model): disable it, or give it a switch"
                )
        return _SwitchedOff(tuple(self.switches.values()))

    def init_plan(self, model: nn.Module) -> list[tuple[nn.Parameter, Fill]]:
        """(parameter, fill) of every added parameter, in the order of their names: after the
        model's own plan, which is thus drawn as in a plain run."""
        params = dict(model.named_parameters())
        return [(params[name], self.added[name].init) for name in sorted(self.added)]

    @contextlib.contextmanager
    def tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh) -> Iterator[None]:
        """Apply the model's tensor-parallel plan (the ``with`` body) without the added
        parameters, then place each by its style (a plan by module names would shard every
        parameter of a ``Linear`` as its weight is) and freeze again what the plan's new
        parameters unfroze."""
        for name, added in self.added.items():
            if added.tp is None:
                raise PluginError(
                    f"plugin '{added.plugin}' added '{name}' without a tensor-parallel style, "
                    "so parallelism.tp must be 1: set parallelism.tp = 1, or give the "
                    "parameter tp='replicate' or ShardLike(base_name)"
                )
        detached = {name: _pop_parameter(model, name) for name in self.added}
        yield
        params = dict(model.named_parameters())
        # The plan makes new Parameters (the sequence-parallel norms'), trainable by default.
        for name in self.frozen:
            if name in params:
                params[name].requires_grad_(False)
        for name, param in detached.items():
            style = self.added[name].tp
            if isinstance(style, ShardLike):
                placements = style.placements(params[style.base])
            else:
                placements = (Replicate(),)
            dist = distribute_tensor(param.data, tp_mesh, placements, src_data_rank=None)
            owner, _, short = name.rpartition(".")
            tensor = nn.Parameter(dist, requires_grad=param.requires_grad)
            model.get_submodule(owner).register_parameter(short, tensor)

    def store_meta(self, model: nn.Module) -> None:
        """Give each stored parameter of ``model`` (on the meta device, not yet sharded) its
        stored form, for FSDP2 to split and ``to_empty`` to allocate as it is."""
        for name, storage in self.stored.items():
            value = storage.store(torch.empty(model.get_parameter(name).shape, device="meta"))
            _assign(model, name, value)

    @torch.no_grad()
    def load_stored(self, model: nn.Module, name: str, full: torch.Tensor) -> None:
        """Put the full tensor ``full`` into stored parameter ``name`` of ``model``: converted
        whole (NF4's scales are the whole tensor's), then this rank's shard of it kept, so
        that every world size holds the same values. The parameter object is replaced, as
        ``load_state_dict(assign=True)`` does: FSDP2 takes it up."""
        param = model.get_parameter(name)
        value = self.stored[name].store(full.to(param.device, torch.float32))
        if isinstance(param, DTensor):
            local = value
            for mesh_dim, placement in enumerate(param.placements):
                if placement != Replicate():  # FSDP2's Shard(0): tensor parallelism is refused
                    assert placement == Shard(0), f"{name} is placed {param.placements}"
                    parts = param.device_mesh.size(mesh_dim)
                    index = param.device_mesh.get_local_rank(mesh_dim)
                    local = torch.chunk(local, parts, dim=0)[index]
            value = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride(),
            )  # fmt: skip
        _assign(model, name, value)

    def base_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a model state dict) without the added parameters' entries."""
        return {k: v for k, v in state.items() if k not in self.added}

    def exported(self, load: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """The loader of the exported base weights, from ``load`` (the full tensor of any
        parameter, added ones included): the merges are applied, in the order of the names
        of the added parameters that ask for them."""
        merges: dict[str, list[MergeInto]] = {}
        for name in sorted(self.added):
            rule = self.added[name].export
            if isinstance(rule, MergeInto):
                merges.setdefault(rule.into, []).append(rule)

        def exported_load(name: str) -> torch.Tensor:
            tensor = load(name)
            if name in merges:
                added = LazyTensors(tuple(self.added), load)
                shape = tuple(tensor.shape)
                for rule in merges[name]:
                    tensor = rule.fn(tensor, added)
                if tuple(tensor.shape) != shape:
                    raise PluginError(
                        f"the merge into '{name}' gives shape {tuple(tensor.shape)} where the "
                        f"weight is {shape}: fix the plugin's MergeInto function"
                    )
            return tensor

        return exported_load


class LazyTensors(Mapping[str, torch.Tensor]):
    """Full tensors by name, each read (``load(name)``) on first access."""

    def __init__(self, names: tuple[str, ...], load: Callable[[str], torch.Tensor]) -> None:
        self._names, self._load, self._read = names, load, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._read:
            self._read[name] = self._load(name)
        return self._read[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter ``name`` of ``model`` by a frozen one of ``value``, through the
    owner's ``load_state_dict(assign=True)``, whose hook FSDP2 re-registers it by."""
    owner, _, short = name.rpartition(".")
    parameter = nn.Parameter(value, requires_grad=False)
    model.get_submodule(owner).load_state_dict({short: parameter}, strict=False, assign=True)


def _pop_parameter(model: nn.Module, name: str) -> nn.Parameter:
    owner, _, short = name.rpartition(".")
    module = model.get_submodule(owner)
    param = module._parameters.pop(short)
    assert param is not None
    return param


class _SwitchedOff(contextlib.AbstractContextManager[None]):
    """Every switch off on entry, on again on exit (even on an exception)."""

    def __init__(self, switches: tuple[Switch, ...]) -> None:
        self.switches = switches

    def __enter__(self) -> None:
        for switch in self.switches:
            switch(False)

    def __exit__(self, *exc: object) -> None:
        for switch in self.switches:
            switch(True)


def conversion_of(model: nn.Module) -> Conversion:
    """The :class:`Conversion` of ``model``: a new, empty one if no plugin has converted it."""
    conversion = getattr(model, _ATTRIBUTE, None)
    if conversion is None:
        conversion = Conversion()
        object.__setattr__(model, _ATTRIBUTE, conversion)
    return conversion
