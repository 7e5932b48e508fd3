"""Example plugtrain plugin: vetoes chosen steps in ``pre_step`` and logs how many it vetoed.

It is the smallest plugin with a config section, a veto and a metric. Recording hook calls is
the test kit's job (``plugtrain.testing.HookLog``, and ``plugtrain.testing.tiny_run``'s
``hooks``); the plugin keeps its historical name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plugtrain.plugin import SetupContext, StepContext, hookimpl


@dataclass
class HookRecorderConfig:
    veto_steps: list[int] = field(default_factory=list)
    """Optimizer steps (1-based) this plugin vetoes in ``pre_step``."""


class HookRecorder:
    """Vetoes the steps of ``veto_steps``, giving a reason, and logs ``vetoed_steps``."""

    def __init__(self) -> None:
        self.config = HookRecorderConfig()
        self.vetoed = 0

    @hookimpl
    def config_section(self) -> type:
        return HookRecorderConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)

    @hookimpl
    def pre_step(self, ctx: StepContext) -> str | None:
        # The step is known on the host: deciding from it costs no device read.
        if ctx.step in self.config.veto_steps:
            self.vetoed += 1
            return f"hook_recorder vetoes step {ctx.step} (veto_steps)"
        return None

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> dict[str, int]:
        return {"vetoed_steps": self.vetoed}
