"""The model hooks: wrap_model then compile_model, on the meta device, before FSDP2."""

from __future__ import annotations

import pytest
import torch

from plugtrain.errors import PluginError
from plugtrain.plugin import ModelContext, hookimpl, wrap_forward
from plugtrain.testing import make_trainer, parameter_checksums


class Wrapper:
    """Doubles then halves each block's output (exact in fp32), recording what it saw."""

    def __init__(self, log: list) -> None:
        self.log = log

    @hookimpl
    def wrap_model(self, ctx: ModelContext) -> None:
        self.log.append(("wrap", ctx.model.output.weight.device.type, len(ctx.blocks)))
        for block in ctx.blocks:
            wrap_forward(block, lambda forward: lambda *a, **kw: forward(*a, **kw) * 2 / 2)


class Compiler:
    """A stand-in compiler: checks that every wrapper came first, counts block and loss calls."""

    def __init__(self, log: list) -> None:
        self.log, self.calls, self.loss_calls = log, 0, 0

    @hookimpl
    def compile_model(self, ctx: ModelContext) -> None:
        ctx.register_compiler(self)
        wrapped = all("forward" in vars(block) for block in ctx.blocks)
        self.log.append(
            ("compile", wrapped, ctx.device.type, ctx.param_dtype, ctx.parallel_dims.world_size)
        )

        def count(forward):
            def counted(*args, **kwargs):
                self.calls += 1
                return forward(*args, **kwargs)

            return counted

        for block in ctx.blocks:
            wrap_forward(block, count)
        loss_fn = ctx.loss_fn

        def counted_loss(logits, targets):
            self.loss_calls += 1
            return loss_fn(logits, targets)

        ctx.loss_fn = counted_loss


@pytest.mark.parametrize("compiler_first", [True, False])
def test_wrappers_run_before_the_compiler_whatever_the_registration_order(tmp_path, compiler_first):
    log: list = []
    plugins = [("wrapper", Wrapper(log)), ("compiler", Compiler(log))]
    if compiler_first:
        plugins.reverse()
    trainer = make_trainer(
        tmp_path, "--training.mixed_precision_param", "bfloat16", plugins=plugins
    )
    assert log == [("wrap", "meta", 2), ("compile", True, "cpu", torch.bfloat16, 1)]
    trainer.run()
    assert dict(plugins)["compiler"].calls == 3 * 2  # 3 steps, 2 blocks
    assert dict(plugins)["compiler"].loss_calls == 3  # the trainer's loss is the compiler's


def test_a_wrapped_model_trains_to_the_same_parameters_with_the_same_names(tmp_path):
    plain = make_trainer(tmp_path / "plain")
    wrapped = make_trainer(tmp_path / "wrapped", plugins=[("wrapper", Wrapper([]))])
    names = [name for name, _ in plain.model.named_parameters()]
    assert [name for name, _ in wrapped.model.named_parameters()] == names
    assert list(wrapped.model.state_dict()) == list(plain.model.state_dict())
    for trainer in (plain, wrapped):
        trainer.run()
    assert parameter_checksums(wrapped.model) == parameter_checksums(plain.model)


def test_two_compilers_are_refused_naming_both(tmp_path):
    plugins = [("first", Compiler([])), ("second", Compiler([]))]
    with pytest.raises(
        PluginError,
        match=r"plugins '(first|second)' and '(first|second)' both "
        r"compile the model: enable only one of them",
    ):
        make_trainer(tmp_path, plugins=plugins)
