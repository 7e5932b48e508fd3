"""The config system: TOML, command-line overrides, and every kind of bad input."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from plugtrain import config, sample
from plugtrain.config import (
    CORE_SECTIONS,
    SHIPPED_CONFIGS,
    JobConfig,
    build_config,
    coerce,
    format_help,
    merged_values,
    parse_command_line,
    section_doc,
)
from plugtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def config_from(argv: list[str], plugin_sections: dict | None = None, installed=()):
    return build_config(merged_values(parse_command_line(argv)), plugin_sections or {}, installed)


def test_defaults_are_the_debug_run():
    cfg = config_from([])
    assert cfg.model.flavor == "debug"
    assert cfg.training.mixed_precision_param == "float32"
    assert cfg.training.mixed_precision_reduce == "float32"
    assert cfg.plugins.enabled == []


def test_default_paths_name_the_shipped_sample_and_other_paths_stay_relative():
    cfg = config_from([])
    paths = [cfg.model.tokenizer_path, cfg.data.train_path, cfg.data.validation_path]
    assert paths == ["sample:tokenizer.json", "sample:train.jsonl", "sample:validation.jsonl"]
    assert [sample.resolve(p) for p in paths] == [
        sample.FOLDER / name for name in ("tokenizer.json", "train.jsonl", "validation.jsonl")
    ]
    assert all(sample.resolve(p).is_file() for p in paths)
    assert sample.resolve("data/train.jsonl") == Path("data/train.jsonl")


def test_config_names_a_shipped_config_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    debug = tomllib.loads((REPO / "configs" / "debug.toml").read_text())
    assert merged_values(parse_command_line(["--config", "debug"])) == debug
    (tmp_path / "debug").write_text("[training]\nsteps = 3\n")  # a file of that name wins
    assert merged_values(parse_command_line(["--config", "debug"])) == {"training": {"steps": 3}}
    with pytest.raises(ConfigError) as e:
        merged_values(parse_command_line(["--config", "debgu"]))
    assert str(e.value) == (
        "config file 'debgu' not found: pass an existing file to --config, or the name of a "
        "shipped config (chat_debug, debug, dpo_debug, llama3_405b, llama3_70b, llama3_8b, "
        "qwen3_30b_a3b)"
    )


def test_every_section_of_the_config_package_is_a_field_of_job_config():
    # A new core section is a module of plugtrain/config/ and a field of JobConfig: forgetting
    # the field would leave the section out of TOML, the command line and --help.
    modules = [
        importlib.import_module(f"plugtrain.config.{m.name}")
        for m in pkgutil.iter_modules(config.__path__)
    ]
    sections = {
        cls
        for module in modules
        for cls in vars(module).values()
        if dataclasses.is_dataclass(cls)
        and cls.__module__ == module.__name__
        and cls.__name__.endswith("Config")
    }
    assert len(modules) >= 8
    assert sections - {JobConfig} == set(CORE_SECTIONS.values())
    fields = [f.name for f in dataclasses.fields(JobConfig)]
    assert [*CORE_SECTIONS, "plugin_sections"] == fields
    assert list(config_from([]).to_dict()) == list(CORE_SECTIONS)


def test_the_shipped_configs_are_the_repository_configs():
    # One copy: the package's configs folder links to the repository's.
    ours = sorted((REPO / "configs").glob("*.toml"))
    assert [p.name for p in sorted(SHIPPED_CONFIGS.glob("*.toml"))] == [p.name for p in ours]
    assert all((SHIPPED_CONFIGS / p.name).samefile(p) for p in ours)


def test_toml_then_command_line_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[training]\nsteps = 7\nseq_len = 64\nmixed_precision_param = "bfloat16"\n'
        "[optimizer]\nbetas = [0.8, 0.9]\n"
    )
    cfg = config_from(["--config", str(path), "--training.steps", "9", "--optimizer.lr=0.01"])
    assert cfg.training.steps == 9  # the command line wins
    assert cfg.training.seq_len == 64  # the file applies
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.optimizer.lr == 0.01


def test_list_overrides_accept_commas_and_toml_arrays():
    assert coerce("a, b", list[str], "k") == ["a", "b"]
    assert coerce('["a", "b"]', list[str], "k") == ["a", "b"]
    assert coerce("[]", list[str], "k") == []
    assert coerce("inf", float, "k") == float("inf")
    assert coerce("false", bool, "k") is False


def test_unions_take_the_first_member_that_accepts_the_value():
    auto_or_bool = bool | Literal["auto"]
    assert coerce(True, auto_or_bool, "k") is True  # TOML true
    assert coerce("false", auto_or_bool, "k") is False  # --s.k false
    assert coerce("auto", auto_or_bool, "k") == "auto"
    with pytest.raises(ConfigError, match=r"^config key 'k' must be bool or 'auto', got 'maybe'$"):
        coerce("maybe", auto_or_bool, "k")
    with pytest.raises(ConfigError, match=r"^config key 'k' must be bool or 'auto', got 'none'$"):
        coerce("none", auto_or_bool, "k")  # None only where the union admits it
    assert coerce("none", int | None, "k") is None
    assert coerce("3", int | None, "k") == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainig.steps", "3"], "unknown config section [trainig] (did you mean 'training'?)"),
        (["--training.stepz", "3"], "unknown config key 'training.stepz' (did you mean 'steps'?)"),
        (["--training.steps", "three"], "config key 'training.steps' must be int, got 'three'"),
        (["--training.steps", "0"], "config key 'training.steps' must be >= 1, got 0"),
        (["--optimizer.lr", "-1"], "config key 'optimizer.lr' must be finite and > 0, got -1.0"),
        (
            ["--training.mixed_precision_param", "float61"],
            "config key 'training.mixed_precision_param' is 'float61' (did you mean 'float16'?)",
        ),
        (
            ["--model.flavor", "debgu"],
            "config key 'model.flavor' is 'debgu' (did you mean 'debug'?)",
        ),
        (["--training.steps"], "argument '--training.steps' needs a value"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--steps", "3"], "argument '--steps' must be --section.key"),
        (["--config", "/nonexistent.toml"], "config file '/nonexistent.toml' not found"),
        (["--optimizer.lr", "inf"], "config key 'optimizer.lr' must be finite and > 0, got inf"),
        (
            ["--lr_scheduler.decay_type", "wsd"],
            "config key 'lr_scheduler.decay_steps' must be set when decay_type is 'wsd'",
        ),
        (
            ["--lr_scheduler.decay_type", "wsd", "--lr_scheduler.decay_steps", "181"],
            "config keys 'lr_scheduler.warmup_steps' (20) + 'lr_scheduler.decay_steps' (181) "
            "exceed 'training.steps' (200): lower them or raise training.steps",
        ),
        (
            ["--lr_scheduler.decay_steps", "50"],
            "config key 'lr_scheduler.decay_steps' applies to decay_type 'wsd' only, but "
            "decay_type is 'cosine': remove decay_steps or set decay_type = 'wsd'",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        config_from(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_an_option_where_a_value_belongs_is_a_missing_value():
    with pytest.raises(ConfigError) as e:
        config_from(["--training.steps", "--validation.interval", "0"])
    assert str(e.value) == (
        "argument '--training.steps' needs a value, but '--validation.interval' follows it: "
        "write --training.steps=VALUE for a value that starts with --"
    )
    assert config_from(["--job.description=--x"]).job.description == "--x"


def test_a_list_in_brackets_needs_no_quotes():
    assert coerce("[grad_clip]", list[str], "k") == ["grad_clip"]
    assert coerce(" [grad_clip, ema] ", list[str], "k") == ["grad_clip", "ema"]
    assert coerce("[1, 2]", list[int], "k") == [1, 2]
    assert config_from(["--plugins.enabled", "[]"]).plugins.enabled == []


@pytest.mark.parametrize("text", ["[{path=a}]", "[grad_clip", "['a\", 'b']"])
def test_a_list_that_cannot_be_read_says_how_to_write_one(text):
    with pytest.raises(ConfigError) as e:
        coerce(text, list[str], "plugins.enabled")
    assert str(e.value) == (
        f"config key 'plugins.enabled' cannot be read as a list from {text!r}: write a,b or a "
        """TOML array such as '["a", "b"]', quoting the strings inside brackets"""
    )


def test_help_says_how_to_write_a_list():
    assert 'A list is written a,b or a TOML array such as \'["a", "b"]\': ' in format_help({})


def test_malformed_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match=f"config file '{path}' is not valid TOML"):
        config_from(["--config", str(path)])


@dataclass
class ExampleSection:
    max_norm: float = 1.0
    """Doc of max_norm."""
    names: list[str] = field(default_factory=list)


def test_plugin_sections_are_typed_and_checked():
    cfg = config_from(["--ex.max_norm", "2"], {"ex": ExampleSection})
    assert cfg.plugin("ex") == ExampleSection(max_norm=2.0)
    with pytest.raises(ConfigError, match=r"unknown config key 'ex.max_nrom' \(did you mean"):
        config_from(["--ex.max_nrom", "2"], {"ex": ExampleSection})


def test_section_of_a_disabled_plugin_says_enable_it():
    with pytest.raises(ConfigError, match="configures plugin 'ex', which is not enabled: add 'ex'"):
        config_from(["--ex.max_norm", "2"], {}, installed=["ex"])


def test_help_lists_fields_with_their_docs():
    text = format_help({"ex": ExampleSection})
    assert "--training.mixed_precision_param (" in text
    assert "FSDP2 MixedPrecisionPolicy param_dtype" in text
    assert "--ex.max_norm (float; default 1.0)" in text
    assert "Doc of max_norm." in text


@dataclass
class ChoicesSection:
    """Doc of the section."""

    mode: Literal["a", "b"] = "a"
    enabled: bool | Literal["auto"] = "auto"
    limit: int | None = None
    names: list[str] = field(default_factory=list)


def test_help_lists_the_choices_of_fields_with_fixed_choices():
    lines = format_help({"ch": ChoicesSection}).splitlines()
    assert "  --ch.mode (one of 'a', 'b'; default 'a')" in lines
    assert "  --ch.enabled (bool or 'auto'; default 'auto')" in lines
    assert "  --ch.limit (int or None; default None)" in lines
    assert "  --ch.names (list of str; default [])" in lines
    assert "  --training.device (one of 'auto', 'cpu', 'cuda'; default 'auto')" in lines
    flavors = (
        "'tiny', 'tiny4', 'debug', '1B', '3B', '8B', '70B', '405B', 'debug_moe', "
        "'qwen3_30b_a3b', 'hf'"
    )
    assert f"  --model.flavor (one of {flavors}; default 'debug')" in lines


def test_help_prints_each_section_docstring_under_its_heading():
    lines = format_help({"ch": ChoicesSection, "ex": ExampleSection}).splitlines()
    assert lines[lines.index("[ch]") + 1] == "  Doc of the section."
    assert lines[lines.index("[ex]") + 1].startswith("  --ex.")  # none: not the signature
    for name, cls in CORE_SECTIONS.items():
        doc = section_doc(cls)
        assert doc and "\n" not in doc, f"{name} needs a one-line class docstring"
        assert lines[lines.index(f"[{name}]") + 1] == f"  {doc}"


def test_help_names_installed_plugins_that_are_not_enabled_and_how_to_see_them():
    lines = format_help({"ex": ExampleSection}, ["bare", "other"], "plugtrain train").splitlines()
    assert lines[-2:] == [
        "Installed plugins that are not enabled: bare, other.",
        "Their sections show once enabled: plugtrain train --plugins.enabled NAME,... --help",
    ]
    assert "[ex]" in lines and "[bare]" not in lines
    assert "Installed plugins" not in format_help({"ex": ExampleSection})


def test_to_dict_includes_plugin_sections():
    cfg = config_from(["--ex.max_norm", "3"], {"ex": ExampleSection})
    d = cfg.to_dict()
    assert d["ex"] == {"max_norm": 3.0, "names": []}
    assert d["training"]["steps"] == cfg.training.steps
