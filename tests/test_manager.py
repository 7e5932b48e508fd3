"""Plugin discovery, loading and registration errors."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import textwrap

import pytest

from plugtrain.errors import ConfigError, PluginError
from plugtrain.host.plugin_host import ENTRY_POINT_GROUP, PluginHost, installed_plugins
from plugtrain.plugin import SetupContext, hookimpl
from plugtrain.testing import read_metrics, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer


def fake_entry_points(monkeypatch, **targets: str) -> None:
    """Make ``installed_plugins`` see extra entry points ``name=module:attr``."""
    real = md.entry_points
    extra = [md.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in targets.items()]

    def entry_points(**kw):
        found = real(**kw)
        return md.EntryPoints([*found, *extra]) if kw.get("group") == ENTRY_POINT_GROUP else found

    monkeypatch.setattr(md, "entry_points", entry_points)


def fake_distribution(tmp_path, monkeypatch, dist: str, version: str, **targets: str) -> None:
    """Put a metadata-only distribution ``dist`` providing ``name=module:attr`` on the import
    path."""
    info = tmp_path / "fake_site" / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    entry_points = "".join(f"{name} = {value}\n" for name, value in targets.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_points}")
    monkeypatch.syspath_prepend(str(tmp_path / "fake_site"))


def test_unknown_name_lists_available_plugins():
    with pytest.raises(PluginError) as e:
        PluginHost().load_enabled(["hook_recordr"])
    msg = str(e.value)
    assert "plugins.enabled names 'hook_recordr', which no installed plugin provides" in msg
    assert "(did you mean 'hook_recorder'?)" in msg
    assert "installed plugins: " in msg and "hook_recorder" in msg


def test_import_failure_names_plugin_and_distribution(monkeypatch):
    fake_entry_points(monkeypatch, broken="plugtrain_no_such_module_xyz:Plugin")
    with pytest.raises(PluginError) as e:
        PluginHost().load_enabled(["broken"])
    assert "plugin 'broken' (distribution '?' ?) failed to import" in str(e.value)
    assert "ModuleNotFoundError" in str(e.value)


class TypoPlugin:
    @hookimpl
    def pre_stepp(self, ctx):  # the typo under test
        pass


class ExtraArgPlugin:
    @hookimpl
    def pre_step(self, ctx, optimizer_state):  # the hook gives no optimizer_state
        pass


class NeedsArgs:
    def __init__(self, required):
        self.required = required


def test_help_survives_a_broken_plugin_that_is_not_enabled(monkeypatch, capsys):
    fake_entry_points(monkeypatch, broken="plugtrain_no_such_module_xyz:Plugin")
    assert configure(["--help"]) is None  # named, never imported
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"Installed plugins that are not enabled: [^.]*\bbroken\b", out), out


def test_typo_hook_is_refused_with_suggestion():
    with pytest.raises(PluginError) as e:
        PluginHost().register(TypoPlugin(), "typo")
    assert "plugin 'typo' implements hook 'pre_stepp', which does not exist" in str(e.value)
    assert "(did you mean 'pre_step'?)" in str(e.value)


def test_argument_the_hook_does_not_give_is_refused():
    with pytest.raises(PluginError) as e:
        PluginHost().register(ExtraArgPlugin(), "extra")
    msg = str(e.value)
    assert msg.startswith("plugin 'extra': ")
    assert "optimizer_state" in msg and "\n" not in msg


def test_entry_point_to_class_with_arguments_is_explained(monkeypatch):
    fake_entry_points(monkeypatch, needy=f"{__name__}:NeedsArgs")
    with pytest.raises(PluginError) as e:
        PluginHost().load_enabled(["needy"])
    assert str(e.value) == (
        "plugin 'needy': its entry point must name a module or a callable taking no arguments, "
        f"but '{__name__}:NeedsArgs' cannot be called without any: missing a required argument: "
        "'required'"
    )


OLD_API_PLUGIN = """
import json

from plugtrain.plugin import check_field


class OldApi:
    def __init__(self):
        check_field(True, "old_api", "max_norm", "must be > 0")  # the 0.x signature


class BadDefaults:
    def __init__(self):
        self.defaults = json.loads("{")  # fails inside json, called from line 14
"""


@pytest.mark.parametrize(
    ("attr", "line", "error"),
    [
        ("OldApi", 9, "TypeError: check_field() takes 3 positional arguments but 4 were given"),
        ("BadDefaults", 14, "JSONDecodeError: Expecting property name enclosed in double quotes"),
    ],
)
def test_an_error_in_the_plugins_own_code_is_reported_at_its_line(
    tmp_path, monkeypatch, attr, line, error
):
    (tmp_path / "plugtrain_old_api.py").write_text(OLD_API_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plugtrain_old_api", raising=False)
    fake_entry_points(monkeypatch, old=f"plugtrain_old_api:{attr}")
    with pytest.raises(PluginError) as e:
        PluginHost().load_enabled(["old"])
    assert str(e.value).startswith(
        f"plugin 'old' (distribution '?' ?) failed while 'plugtrain_old_api:{attr}' made it, at "
        f"{tmp_path / 'plugtrain_old_api.py'}:{line}: {error}"
    )
    assert str(e.value).endswith(
        "(fix the plugin, or install a version of it written for plugtrain's plugin API 1.0)"
    )
    assert "\n" not in str(e.value)


class WrapsMetrics:
    @hookimpl(wrapper=True)
    def step_metrics(self, ctx):
        return (yield)


class WrapsVetoesOldStyle:
    @hookimpl(hookwrapper=True)
    def pre_step(self, ctx):
        yield


@pytest.mark.parametrize(
    ("plugin", "hook"), [(WrapsMetrics(), "step_metrics"), (WrapsVetoesOldStyle(), "pre_step")]
)
def test_a_wrapper_of_a_result_hook_is_refused_in_one_line(plugin, hook):
    host = PluginHost()
    with pytest.raises(PluginError) as e:
        host.register(plugin, "wraps")
    assert str(e.value) == (
        f"plugin 'wraps' implements result hook '{hook}' as a wrapper, which would see the other "
        "plugins' answers: drop wrapper=True/hookwrapper=True from its hookimpl"
    )
    assert host.names() == []  # not left half-registered


def test_enabled_twice_is_refused():
    with pytest.raises(PluginError, match="plugin 'hook_recorder' is enabled twice"):
        PluginHost().load_enabled(["hook_recorder", "hook_recorder"])


class LossScaler:
    @hookimpl
    def setup(self, ctx):
        ctx.register_loss_scaler(self)


def test_two_loss_scalers_are_refused():
    host = PluginHost()
    host.register(LossScaler(), "a")
    host.register(LossScaler(), "b")
    ctx = SetupContext(*[None] * 8, name_of=host.name_of, export_hf=None)
    with pytest.raises(PluginError, match=r"plugins '[ab]' and '[ab]' both scale the loss"):
        host.setup(ctx)


def test_plugin_under_another_entry_point_name_finds_its_config(monkeypatch, tmp_path):
    fake_entry_points(monkeypatch, clip="plugtrain_grad_clip:GradClip")
    config, host = configure(
        [*tiny_args(tmp_path, steps=1), "--plugins.enabled", "clip", "--clip.max_norm", "0.25"]
    )
    with pytest.raises(ConfigError, match=r"config key 'clip\.max_norm' must be finite and > 0"):
        configure([*tiny_args(tmp_path), "--plugins.enabled", "clip", "--clip.max_norm", "0"])
    trainer = Trainer(config, host)
    trainer.run()
    plugin = host.get("clip")
    assert plugin.name == "clip" and plugin.config.max_norm == 0.25
    assert set(read_metrics(tmp_path)[0]) >= {"clip/grad_norm", "clip/clipped"}


@pytest.fixture
def clashing_grad_clip(tmp_path, monkeypatch):
    """A second distribution, 'evil-grad-clip' 9.9, that also provides 'grad_clip'."""
    fake_distribution(tmp_path, monkeypatch, "evil-grad-clip", "9.9", grad_clip="evil:Clip")


def test_clash_stops_only_a_run_that_enables_the_name(clashing_grad_clip, tmp_path):
    providers = installed_plugins()["grad_clip"]
    assert {p.distribution for p in providers} == {"plugtrain-grad-clip", "evil-grad-clip"}
    configure([*tiny_args(tmp_path), "--plugins.enabled", "hook_recorder"])  # no error
    with pytest.raises(PluginError) as e:
        configure([*tiny_args(tmp_path), "--plugins.enabled", "hook_recorder,grad_clip"])
    msg = str(e.value)
    assert msg.startswith("plugin name 'grad_clip' is provided by '")
    assert "'plugtrain-grad-clip' 0.1.0" in msg and "'evil-grad-clip' 9.9" in msg
    assert ": pip uninstall all but one of them, or remove 'grad_clip' from" in msg
    assert "\n" not in msg


def test_plugins_command_lists_both_clashing_distributions(clashing_grad_clip, capsys):
    from plugtrain.cli import main

    assert main(["plugins", "--plugins.enabled", "grad_clip,hook_recorder"]) == 0
    rows = [line.split(None, 4) for line in capsys.readouterr().out.splitlines()]
    clip = {row[2]: row for row in rows if row[0] == "grad_clip"}
    assert set(clip) == {"plugtrain-grad-clip", "evil-grad-clip"}
    assert clip["evil-grad-clip"][1:4] == ["yes", "evil-grad-clip", "9.9"]
    assert clip["evil-grad-clip"][4] == (
        "(clash: 'grad_clip' is also provided by 'plugtrain-grad-clip'; uninstall one)"
    )
    assert "setup, pre_step" in next(row[4] for row in rows if row[0] == "hook_recorder")


def test_plugin_config_key_that_does_not_exist():
    with pytest.raises(ConfigError, match=r"unknown config key 'hook_recorder\.vetosteps'"):
        configure(["--plugins.enabled", "hook_recorder", "--hook_recorder.vetosteps", "[1]"])


PLUGIN_SOURCE = '''
"""A third-party plugin, built and installed as a real distribution by the test."""
from plugtrain.plugin import hookimpl

FIRED = []

@hookimpl
def post_step(ctx):
    FIRED.append(ctx.step)
'''


def build_and_install(tmp_path, name: str) -> None:
    src = tmp_path / "src" / name
    (src / f"plugtrain_{name}").mkdir(parents=True)
    (src / f"plugtrain_{name}" / "__init__.py").write_text(PLUGIN_SOURCE)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "plugtrain-{name}"
        version = "1.2.3"
        [project.entry-points."plugtrain.plugins"]
        {name} = "plugtrain_{name}"
        """)
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(tmp_path / "site"), str(src)],
        check=True,
    )  # fmt: skip


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Two real distributions, 'tp_on' and 'tp_off', pip-installed into a fresh folder."""
    for name in ("tp_on", "tp_off"):
        build_and_install(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield
    for name in ("tp_on", "tp_off"):
        sys.modules.pop(f"plugtrain_{name}", None)


def test_installed_distribution_is_discovered_enabled_and_fires(third_party, tmp_path):

    from plugtrain.training.trainer import Trainer

    plugins = installed_plugins()
    (tp_on,) = plugins["tp_on"]
    assert (tp_on.distribution, tp_on.version) == ("plugtrain-tp_on", "1.2.3")
    config, host = configure([*tiny_args(tmp_path / "run", steps=2), "--plugins.enabled", "tp_on"])
    trainer = Trainer(config, host)
    trainer.run()
    assert sys.modules["plugtrain_tp_on"].FIRED == [1, 2]
    assert "plugtrain_tp_off" not in sys.modules  # installed, not enabled: never imported


def test_plugins_command_lists_without_importing_disabled(third_party, capsys):
    from plugtrain.cli import main

    assert main(["plugins", "--plugins.enabled", "tp_on,hook_recorder"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["tp_on"].split()[1:4] == ["yes", "plugtrain-tp_on", "1.2.3"]
    assert lines["tp_on"].endswith("post_step")
    assert lines["tp_off"].split()[1] == "no"
    assert "(not loaded: plugtrain_tp_off)" in lines["tp_off"]
    assert "setup, pre_step, step_metrics" in lines["hook_recorder"]
    assert "plugtrain_tp_off" not in sys.modules
