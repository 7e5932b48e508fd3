"""plugtrain plugin: ``torch.compile`` each transformer block's forward and the loss path.

It compiles in the ``compile_model`` hook, after every wrapper (activation checkpointing) and
before FSDP2 shards the blocks, so each compiled region is a whole block, wrappers included,
and FSDP2's all-gather and reshard hooks, which run around the block's forward, stay outside
it. The forward is replaced in place: parameter names and checkpoints are those of the run
without it. The loss path is compiled too: the final norm's forward and the trainer's loss
function (``ctx.loss_fn``, the fp32 cross-entropy, whose log-softmax and its backward are the
largest elementwise work of a step); the output projection between them is one matmul, which
compiling would not change.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from plugtrain.plugin import (
    ConfigError,
    ModelContext,
    check_field,
    hookimpl,
    refuse_tensor_parallel,
    wrap_forward,
)

__all__ = ["Compile", "CompileConfig", "cpp_compiler"]


@dataclass
class CompileConfig:
    backend: str = "inductor"
    """The ``torch.compile`` backend: ``inductor`` (generates kernels: needs a C++ compiler on
    CPU), ``aot_eager`` (traces forward and backward, runs them eagerly: no speed-up, checks
    that the model compiles), ``eager``, or any of ``torch.compiler.list_backends()``."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    """inductor's mode (other backends take none)."""
    fullgraph: bool = True
    """Fail on a graph break instead of splitting a block into several graphs."""
    dynamic: bool = False
    """Compile for dynamic shapes; a run's shapes are fixed (``training.seq_len``), so off."""

    def __post_init__(self) -> None:
        backends = torch.compiler.list_backends(exclude_tags=())
        check_field(
            self.backend in backends,
            "backend",
            f"is '{self.backend}', which torch.compile does not know: use one of "
            f"{', '.join(backends)}",
        )
        check_field(
            self.mode == "default" or self.backend == "inductor",
            "mode",
            f"'{self.mode}' is inductor's, but backend is '{self.backend}': set mode = 'default'",
        )


def cpp_compiler() -> str:
    """The C++ compiler inductor's CPU code generation runs: ``$CXX``, else its default."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


class Compile:
    """Compiles each block's forward, the final norm's and the loss in ``compile_model``."""

    def __init__(self) -> None:
        self.compiled_blocks = 0
        """How many blocks this run compiled (set in ``compile_model``)."""

    @hookimpl
    def config_section(self) -> type:
        return CompileConfig

    @hookimpl
    def compile_model(self, ctx: ModelContext) -> None:
        config: CompileConfig = ctx.plugin_config(self)
        ctx.register_compiler(self)
        name = ctx.name_of(self)
        # Under TP, torch 2.13's AOTAutograd (aot_eager, inductor) fails in a compiled block's
        # backward: "'Tensor' object has no attribute '_local_tensor'" (CPU, gloo; tp 2).
        refuse_tensor_parallel(ctx.parallel_dims, name)
        ep = ctx.parallel_dims.ep
        if ep > 1 and config.fullgraph:
            # The all-to-all's split sizes are read on the host in each block: a graph break.
            raise ConfigError(
                f"{name}.fullgraph = true, but under parallelism.ep = {ep} each block reads its "
                f"experts' token counts on the host (a graph break): set {name}.fullgraph = "
                f"false, or parallelism.ep = 1"
            )
        on_cpu = config.backend == "inductor" and ctx.device.type == "cpu"
        if on_cpu and shutil.which(cpp_compiler()) is None:
            raise ConfigError(
                f"{name}.backend = 'inductor' on CPU needs a C++ compiler, and "
                f"'{cpp_compiler()}' is not on PATH: install one (or set CXX to it), or set "
                f"{name}.backend = 'aot_eager', or remove '{name}' from plugins.enabled"
            )
        options: dict[str, Any] = {
            "backend": config.backend,
            "fullgraph": config.fullgraph,
            "dynamic": config.dynamic,
        }
        if config.mode != "default":
            options["mode"] = config.mode
        compiled = functools.partial(_compiled, name=name, options=options)
        for block in ctx.blocks:
            wrap_forward(block, compiled)
        wrap_forward(ctx.norm, compiled)
        ctx.loss_fn = compiled(ctx.loss_fn)
        self.compiled_blocks = len(ctx.blocks)


# A block's forward may record what it did (the moe family's router statistics and token
# counts), once per step: eagerly, activation checkpointing's recompute skips it (the moe layer
# checks the autograd graph task); compiled, dynamo refuses such a side effect inside a
# checkpoint unless told not to replay it in the backward.
_FORWARD_SIDE_EFFECTS_ONCE = torch._dynamo.config.patch(
    skip_fwd_side_effects_in_bwd_under_checkpoint=True
)


def _compiled(
    forward: Callable[..., Any], name: str, options: dict[str, Any]
) -> Callable[..., Any]:
    """``torch.compile(forward, **options)``, whose backend's failure (it compiles at the first
    call) is re-raised as one line naming the config key."""
    compiled = torch.compile(forward, **options)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            with _FORWARD_SIDE_EFFECTS_ONCE:
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{name}.backend = '{options['backend']}' failed to compile the model: "
                f"{first_line}; set {name}.backend = 'aot_eager' or 'eager', or remove "
                f"'{name}' from plugins.enabled"
            ) from e

    return run
