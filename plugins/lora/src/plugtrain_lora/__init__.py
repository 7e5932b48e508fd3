"""lora: trains low-rank adapters on the model's projections, the base frozen (LoRA).

Each target ``nn.Linear`` (``layers.N.attention.wq`` ...) keeps its ``weight`` and gains two
parameters in the conversion phase (``convert_model``), ``lora_a`` (rank x in) and ``lora_b``
(out x rank); its class is swapped in place for a subclass whose forward adds
``alpha / rank * B (A dropout(x))`` to the base product, as torchtitan's
``components/lora.py`` does, rather than renaming modules as HF peft does. The base names, the
checkpoints' base keys, the tensor-parallel plan and the Hugging Face names stay the model's.
Every base parameter is frozen, so the optimizer, gradient hooks and EMA hold the adapters
only. A is Kaiming-uniform and B zero: the first step's model is the base model, bit for bit.

Under tensor parallelism each factor is split as the base weight is along the dimension it
shares with it (A the input columns, B the output rows). ``plugtrain export-hf`` merges
``W + alpha / rank * B @ A`` into each base weight (full tensors, read from the checkpoint);
with ``--adapter`` it writes the adapters alone as a Hugging Face peft folder.

The adapters can be switched off (``ConvertContext.set_switch``): each adapted projection then
skips its adapter branch and computes the base product alone, so that
``plugtrain.plugin.additions_off`` runs the policy as the frozen base model (dpo's
``reference = "adapters_off"``), with no second model, no parameter changed and nothing
allocated.

QLoRA: with ``base_dtype = "nf4"`` the target weights are held in torchao's NF4 (``qlora``),
about half a byte a value; the merge then adds the adapters to the weight as the run computed
with it, read back from NF4.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from plugtrain.plugin import (
    AdapterExport,
    AdapterWriter,
    ConvertContext,
    MergeInto,
    PluginError,
    ShardLike,
    Switch,
    check_field,
    hookimpl,
)
from plugtrain_lora.qlora import EXTRA, NF4, check_nf4, dequantized, torchao_missing

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
"""The projections of a Llama block an adapter can train: attention's and the SwiGLU's."""


@dataclass
class LoraConfig:
    """The ``[lora]`` config section."""

    # They shape the adapters and the base they train on; save_base may change on resume.
    FIXED_ON_RESUME: ClassVar[tuple[str, ...]] = (
        "rank",
        "alpha",
        "dropout",
        "targets",
        "base_dtype",
    )
    rank: int = 8
    """The adapters' rank r: A is r x in, B is out x r."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (peft's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1) (peft's ``lora_dropout``)."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """The projections that get an adapter, in every block, by their module names."""
    save_base: bool = False
    """Whether checkpoints hold the frozen base weights too. By default those of a run that
    starts from ``checkpoint.initial_load_path`` hold the adapters, the optimizer and the run's
    state only; the base is re-read from that folder (its files' sha256 checked) on resume,
    by ``export-hf`` and by ``generate``."""
    base_dtype: Literal["float32", "nf4"] = "float32"
    """How the target weights are held: ``float32``, as the rest of the model, or ``nf4``,
    QLoRA's 4-bit NormalFloat (torchao's, about half a byte a value: ``pip install
    'plugtrain-lora[qlora]'``). The other frozen weights stay float32. An NF4 base is never
    saved: a run that saves checkpoints needs ``checkpoint.initial_load_path``."""

    def __post_init__(self) -> None:
        check_field(self.rank >= 1, "rank", f"must be >= 1, got {self.rank}")
        check_field(0 < self.alpha < math.inf, "alpha", f"must be finite and > 0, got {self.alpha}")
        check_field(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        check_field(
            bool(self.targets), "targets", f"must name at least one of {', '.join(TARGETS)}"
        )
        for target in self.targets:
            check_field(
                target in TARGETS,
                "targets",
                f"names '{target}', which is no projection: choose among {', '.join(TARGETS)}",
            )
        check_field(
            len(set(self.targets)) == len(self.targets),
            "targets",
            f"names a projection twice ({', '.join(self.targets)}): name each once",
        )
        if self.base_dtype == "nf4":
            check_field(not torchao_missing(), "base_dtype", f"'nf4' needs torchao: {EXTRA}")
            check_field(
                not self.save_base,
                "base_dtype",
                "'nf4' is never saved in a checkpoint, but save_base is true: set "
                "lora.save_base = false (the base is re-read from checkpoint.initial_load_path)",
            )

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by."""
        return self.alpha / self.rank


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter: ``x W^T + scale * dropout(x) A^T B^T``.

    Modules become one by :func:`add_adapter`, which swaps their class in place: no module or
    parameter is renamed, and hooks registered on the module (tensor parallelism's, FSDP2's)
    stay where they were."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool
    """False while the adapters are switched off (:func:`switch`): the base product alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return base
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return base + F.linear(F.linear(h, self.lora_a), self.lora_b) * self.lora_scale


def kaiming_uniform(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A's fill: ``nn.Linear``'s own (Kaiming-uniform, a = sqrt(5)), as peft's ``lora_A``."""
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)


def zeros(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """B's fill: zero, so that the adapted model starts as the base model."""
    return t.zero_()


def merge(a: str, b: str, scale: float, nf4: bool) -> Any:
    """The export rule of ``b``: the base weight (read back from NF4 with ``nf4``, as the run
    computed with it) plus ``scale * B @ A``, on full tensors."""

    def merged(weight: torch.Tensor, added: Any) -> torch.Tensor:
        base = dequantized(weight) if nf4 else weight
        return base + scale * (added[b] @ added[a])

    return merged


def add_adapter(plugin: object, ctx: ConvertContext, module: str, config: LoraConfig) -> None:
    """Give linear ``module`` of ``ctx.model`` an adapter of ``config``'s rank."""
    linear = ctx.model.get_submodule(module)
    weight = f"{module}.weight"
    out_dim, in_dim = linear.weight.shape
    a, b = f"{module}.lora_a", f"{module}.lora_b"
    # Each factor is split as the weight is along the dimension they share (A: inputs, B:
    # outputs), whichever of column-wise or row-wise the family's plan makes the weight.
    ctx.add_parameter(
        plugin, module, "lora_a", (config.rank, in_dim),
        init=kaiming_uniform, tp=ShardLike(weight, dim=1), export="drop",
    )  # fmt: skip
    merged = MergeInto(weight, merge(a, b, config.scale, config.base_dtype == "nf4"))
    ctx.add_parameter(
        plugin, module, "lora_b", (out_dim, config.rank),
        init=zeros, tp=ShardLike(weight, dim=0), export=merged,
    )  # fmt: skip
    linear.__class__ = LoraLinear
    linear.lora_scale = config.scale
    linear.lora_dropout = config.dropout
    linear.lora_enabled = True


def switch(linears: list[nn.Module]) -> Switch:
    """The switch of the adapters of ``linears`` (``ConvertContext.set_switch``): a flag each
    forward reads, so FSDP2's hooks and the parameters are untouched (a compiled block
    recompiles once for the other value, then keeps both)."""

    def flip(enabled: bool) -> None:
        for linear in linears:
            linear.lora_enabled = enabled

    return flip


PEFT_PREFIX = "base_model.model."
"""What peft's ``PeftModel`` puts before a module's name in its saved adapters."""


def peft_writer(config: LoraConfig, modules: list[str]) -> AdapterWriter:
    """The writer of the adapters of ``modules`` as a Hugging Face peft LoRA folder:
    ``adapter_config.json`` and ``adapter_model.safetensors``, which
    ``peft.PeftModel.from_pretrained(base, folder)`` applies to the base model."""

    def write(export: AdapterExport) -> None:
        tensors: dict[str, torch.Tensor] = {}
        names: set[str] = set()
        for module in modules:
            a, b = (export.tensors[f"{module}.lora_{x}"] for x in "ab")
            # B's rows are the weight's output rows: laid out as the format lays the weight's.
            hf_name, b = export.to_hf(f"{module}.weight", b)
            hf_module = PEFT_PREFIX + hf_name.removesuffix(".weight")
            names.add(hf_module.rpartition(".")[2])
            tensors[f"{hf_module}.lora_A.weight"] = a.to(export.dtype).contiguous()
            tensors[f"{hf_module}.lora_B.weight"] = b.to(export.dtype).contiguous()
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": export.base_model or None,
            "r": config.rank,
            "lora_alpha": config.alpha,
            "lora_dropout": config.dropout,
            "target_modules": sorted(names),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }
        (export.folder / "adapter_config.json").write_text(
            json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8"
        )
        save_file(tensors, export.folder / "adapter_model.safetensors", {"format": "pt"})

    return write


class Lora:
    """The plugin object: the entry point names this class and plugtrain instantiates it."""

    @hookimpl
    def config_section(self) -> type:
        return LoraConfig

    @hookimpl
    def convert_model(self, ctx: ConvertContext) -> None:
        config: LoraConfig = ctx.plugin_config(self)
        if config.dropout and ctx.parallel_dims.tp_enabled:
            raise PluginError(
                f"lora.dropout = {config.dropout} with parallelism.tp = "
                f"{ctx.parallel_dims.tp} is not supported yet: set lora.dropout = 0.0"
            )
        base = [name for name, _ in ctx.model.named_parameters()]
        linears = {}
        for module, linear in list(ctx.model.named_modules()):
            if module.rpartition(".")[2] not in config.targets:
                continue
            if type(linear) is not nn.Linear:
                raise PluginError(
                    f"lora target '{module}' is a {type(linear).__name__}, not an nn.Linear: "
                    "remove it from lora.targets"
                )
            linears[module] = linear
        nf4 = []
        if config.base_dtype == "nf4":
            check_nf4(ctx, linears)
            nf4 = [f"{module}.weight" for module in linears]
        for module in linears:
            add_adapter(self, ctx, module, config)
        ctx.freeze(self, *(n for n in base if n not in nf4), saved=config.save_base)
        if nf4:
            ctx.freeze(self, *nf4, storage=NF4)
        ctx.set_adapter(self, peft_writer(config, list(linears)))
        ctx.set_switch(self, switch(list(linears.values())))
