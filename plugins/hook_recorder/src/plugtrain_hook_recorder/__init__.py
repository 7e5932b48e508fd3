"""Example plugtrain plugin: records which hooks fired, in order, and vetoes chosen steps."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from plugtrain.plugin import SetupContext, StepContext, hookimpl


@dataclass
class HookRecorderConfig:
    output: str = ""
    """If set, each rank appends its calls as JSON lines to this path plus ``.rank<N>``."""
    veto_steps: list[int] = field(default_factory=list)
    """Optimizer steps (1-based) this plugin vetoes in ``pre_step``."""


@dataclass(frozen=True)
class Call:
    """One hook call as the plugin saw it."""

    hook: str
    step: int
    microbatch: int
    skipped: bool = False


class HookRecorder:
    """Appends a :class:`Call` to ``self.calls`` for every step hook the trainer fires."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.config = HookRecorderConfig()
        self.rank = 0
        self.param_dtype: object = None
        self.vetoed = 0

    @hookimpl
    def config_section(self) -> type:
        return HookRecorderConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)
        self.rank = ctx.rank
        self.param_dtype = ctx.param_dtype
        self.calls.append(Call("setup", 0, 0))

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        self.calls.append(Call("pre_backward", ctx.step, ctx.microbatch))

    @hookimpl
    def unscale_gradients(self, ctx: StepContext) -> None:
        self.calls.append(Call("unscale_gradients", ctx.step, ctx.microbatch))

    @hookimpl
    def observe_gradients(self, ctx: StepContext) -> None:
        self.calls.append(Call("observe_gradients", ctx.step, ctx.microbatch))

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        self.calls.append(Call("post_backward", ctx.step, ctx.microbatch))

    @hookimpl
    def pre_step(self, ctx: StepContext) -> str | None:
        self.calls.append(Call("pre_step", ctx.step, ctx.microbatch))
        if ctx.step in self.config.veto_steps:
            self.vetoed += 1
            return f"hook_recorder vetoes step {ctx.step} (veto_steps)"
        return None

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        # Reading the skip flag is a host sync: fine for a recorder, not for a plugin on the
        # hot path (see the hook contract).
        self.calls.append(Call("post_step", ctx.step, ctx.microbatch, bool(ctx.skipped)))
        if self.config.output:
            path = Path(f"{self.config.output}.rank{self.rank}")
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                for call in self.calls:
                    f.write(json.dumps(call.__dict__) + "\n")
            self.calls.clear()

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> dict[str, int]:
        self.calls.append(Call("step_metrics", ctx.step, ctx.microbatch))
        return {"vetoed_steps": self.vetoed}
