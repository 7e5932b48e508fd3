"""template_plugin: multiplies the gradients by a constant factor after backward.

Made from ``templates/plugin`` by ``scripts/new_plugin.py``: a config section, a ``setup``
that reads it, one step hook and one metric. Keep what you need, replace the rest. Import
only from :mod:`plugtrain.plugin`; :mod:`plugtrain.hookspecs` documents every hook.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtrain.plugin import SetupContext, StepContext, check_field, hookimpl


@dataclass
class TemplatePluginConfig:
    """The ``[template_plugin]`` config section."""

    factor: float = 1.0
    """Multiply every gradient by this in ``post_backward``; 1.0 leaves them alone."""

    def __post_init__(self) -> None:
        check_field(
            self.factor > 0,
            "factor",
            f"must be > 0, got {self.factor}",
        )


class TemplatePlugin:
    """The plugin object: the entry point names this class and plugtrain instantiates it."""

    def __init__(self) -> None:
        self.config = TemplatePluginConfig()

    @hookimpl
    def config_section(self) -> type:
        return TemplatePluginConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)
        if self.config.factor == 1.0:
            ctx.deactivate(self, "factor is 1.0: nothing to do")

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        for grad in ctx.gradients():
            grad.mul_(self.config.factor)

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> dict[str, float]:
        return {"factor": self.config.factor}
