"""The compile plugin: compiled blocks train as the eager ones, and failures say so in a line."""

from __future__ import annotations

import pytest
import torch
from plugtrain_compile import Compile

from plugtrain.plugin import ConfigError, ParallelDims
from plugtrain.testing import make_trainer, model_context, read_metrics

ENABLE = ("--plugins.enabled", "compile")
AOT_EAGER = (*ENABLE, "--compile.backend", "aot_eager")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cache entries, counters or recompile limits carried
    (``reset`` leaves the counters)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def compiled_forward_backward(*args: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The tiny model's training loss (``ctx.loss_fn``) and gradients, compiled as ``args``
    say (no args: eager)."""
    plugin = Compile()
    ctx = model_context({"compile": plugin}, *(ENABLE if args else ()), *args)
    if args:
        plugin.compile_model(ctx)
        assert plugin.compiled_blocks == 2
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss = ctx.loss_fn(ctx.model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in ctx.model.parameters()]


def test_compiled_blocks_and_loss_path_give_the_eager_loss_and_gradients():
    eager_loss, eager_grads = compiled_forward_backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    loss, grads = compiled_forward_backward("--compile.backend", "aot_eager")
    # The blocks' graph (they share it: their parameters are its inputs), the final norm's and
    # the loss's: the whole loss path was compiled.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    for grad, eager in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager, rtol=1e-5, atol=1e-7)


def test_a_run_with_compile_and_activation_checkpointing_trains_as_the_eager_run(plugtrain_run):
    # Under FSDP2, with clipping and two microbatches: the hooks stay outside the compiled blocks.
    common = ("--training.grad_accum_steps", "2", "--grad_clip.max_norm", "0.5")
    plain = plugtrain_run("--plugins.enabled", "grad_clip", *common)
    both = "grad_clip,compile,activation_checkpointing"
    compiled = plugtrain_run("--plugins.enabled", both, "--compile.backend", "aot_eager", *common)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert list(compiled.losses) == [1, 2, 3]
    for step, loss in plain.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, rel=1e-5), step


def test_inductor_without_a_cpp_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(ConfigError) as error:
        make_trainer(tmp_path, *ENABLE)
    assert str(error.value) == (
        "compile.backend = 'inductor' on CPU needs a C++ compiler, and 'no-such-c++-compiler' "
        "is not on PATH: install one (or set CXX to it), or set compile.backend = 'aot_eager', "
        "or remove 'compile' from plugins.enabled"
    )


def test_a_backend_that_fails_at_first_use_is_one_line():
    def failing(graph, example_inputs):
        raise RuntimeError("no kernel for this platform\nmore detail")

    torch._dynamo.register_backend(failing, name="plugtrain_failing")
    with pytest.raises(ConfigError) as error:
        compiled_forward_backward("--compile.backend", "plugtrain_failing")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("compile.backend = 'plugtrain_failing' failed to compile the model: ")
    assert message.endswith(
        "; set compile.backend = 'aot_eager' or 'eager', or remove 'compile' from plugins.enabled"
    )


def test_fullgraph_under_expert_parallelism_is_one_line():
    plugin = Compile()
    dims = ParallelDims(dp_shard=2, ep=2, rank=0)
    ctx = model_context({"compile": plugin}, *AOT_EAGER, parallel_dims=dims)
    with pytest.raises(ConfigError) as error:
        plugin.compile_model(ctx)
    assert str(error.value) == (
        "compile.fullgraph = true, but under parallelism.ep = 2 each block reads its experts' "
        "token counts on the host (a graph break): set compile.fullgraph = false, or "
        "parallelism.ep = 1"
    )
    plugin.compile_model(model_context({"compile": plugin}, *AOT_EAGER, "--compile.fullgraph",
                                       "false", parallel_dims=dims))  # fmt: skip
    assert plugin.compiled_blocks == 2


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--compile.backend", "inductr"), r"'compile.backend' is 'inductr', which torch.compile"),
        (
            ("--compile.backend", "aot_eager", "--compile.mode", "max-autotune"),
            r"'compile.mode' 'max-autotune' is inductor's, but backend is 'aot_eager'",
        ),
    ],
)
def test_bad_config_is_a_config_error(args, match):
    with pytest.raises(ConfigError, match=match):
        model_context({}, *ENABLE, *args)


@pytest.mark.slow
def test_the_moe_family_compiles_whole_blocks_and_trains_as_the_eager_run(tmp_path):
    # fullgraph (the default): the router's statistics and token counts, recorded in the
    # forward, trace; under activation checkpointing they are recorded once a step, as eagerly.
    moe = (
        "--model.family", "moe", "--model.flavor", "debug_moe",
        "--model.moe_aux_loss_weight", "0.01", "--model.moe_bias_update_rate", "0.01",
    )  # fmt: skip
    runs = {}
    for name, plugins in [("eager", ()), ("compiled", ("compile", "activation_checkpointing"))]:
        enabled = ("--plugins.enabled", ",".join(plugins)) if plugins else ()
        backend = ("--compile.backend", "aot_eager") if plugins else ()
        trainer = make_trainer(tmp_path / name, *moe, *enabled, *backend, steps=2)
        trainer.train()
        records = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        runs[name] = records, trainer.runner.balance.state_dict()["expert_bias"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    (records, biases), (eager_records, eager_biases) = runs["compiled"], runs["eager"]
    for record, eager in zip(records, eager_records, strict=True):
        for key in ("loss", "moe/aux_loss", "moe/max_tokens.0", "moe/min_tokens.1"):
            assert record[key] == pytest.approx(eager[key], rel=1e-6), key
    assert eager_biases.any()  # the bias moved: the counts were taken
    assert torch.equal(biases, eager_biases)
