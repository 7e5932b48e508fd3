"""The model families by name, and finding one: ``[model] family`` or a config.json's type.

Free of torch at import (``FAMILIES`` loads a family's spec on first use), so that the config,
and with it ``--help``, can check ``model.family`` without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugtrain.errors import CheckpointError, ConfigError, did_you_mean
from plugtrain.model.spec import ModelSpec

__all__ = ["FAMILIES", "check_family", "hf_model_spec", "model_spec", "unknown_family"]


def _llama() -> ModelSpec:
    from plugtrain.model.llama import LLAMA

    return LLAMA


def _moe() -> ModelSpec:
    from plugtrain.model.moe import MOE

    return MOE


FAMILIES: dict[str, Callable[[], ModelSpec]] = {"llama": _llama, "moe": _moe}
"""Each family's name and what loads its :class:`ModelSpec` (imported on first use: torch)."""


def unknown_family(family: str) -> ConfigError:
    """The one-line error for a ``model.family`` that names no family."""
    return ConfigError(
        f"config key 'model.family' is '{family}'{did_you_mean(family, list(FAMILIES))}; "
        f"choose one of {', '.join(FAMILIES)}"
    )


def model_spec(family: str) -> ModelSpec:
    """The :class:`ModelSpec` of family ``family`` (``[model] family``); a one-line
    :class:`ConfigError` naming the key and the families if there is none."""
    if family not in FAMILIES:
        raise unknown_family(family)
    return FAMILIES[family]()


def hf_model_spec(config: dict[str, Any]) -> ModelSpec:
    """The :class:`ModelSpec` of the family whose ``HFAdapter.model_type`` is config.json's
    ``model_type``; a one-line :class:`CheckpointError` naming it if no family's is."""
    kind = config.get("model_type")
    specs = [load() for load in FAMILIES.values()]
    for spec in specs:
        if spec.hf.model_type == kind:
            return spec
    types = ", ".join(spec.hf.model_type for spec in specs)
    raise CheckpointError(
        f"config.json field 'model_type' is {kind!r}, which no model family reads: give the "
        f"config of one of {types}"
    )


def check_family(config: dict[str, Any], family: str, source: str) -> None:
    """Refuse, in one line, a Hugging Face ``config`` (``source``'s, named in words) whose
    ``model_type`` another family than ``family`` reads: a Qwen3-MoE folder given to the llama
    family, or the reverse."""
    kind = config.get("model_type")
    for name, load in FAMILIES.items():
        if name != family and load().hf.model_type == kind:
            raise ConfigError(
                f"{source} holds a {kind!r} model, which is family '{name}', but model.family "
                f"is '{family}': set model.family = \"{name}\""
            )
