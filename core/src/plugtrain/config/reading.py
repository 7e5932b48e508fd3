"""The generic value reader: a section's values converted, checked and described.

``coerce`` converts one TOML or command-line value to a field's type, ``build_section`` a
section's values to its dataclass, and ``field_docs``, ``section_doc`` and ``help_type`` read
what ``--help`` prints. It knows no section: the core's and the plugins' go through it alike.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import tomllib
import types
import typing
from typing import Any, Literal

from plugtrain.errors import ConfigError, FieldError, did_you_mean


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _choices_name(tp: Any) -> str:
    """``'auto'`` for ``Literal["auto"]``, the type's name otherwise (for error messages)."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return _type_name(tp)


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from TOML, or a command-line string) to type ``tp``, or raise.

    Supports bool, int, float, str, ``Literal[...]``, ``list[X]`` and unions of these
    (``X | None``, ``bool | Literal["auto"]``: the first member that accepts the value wins).
    """
    origin = typing.get_origin(tp)
    from_cli = isinstance(value, str)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"config key '{key}' is {value!r}{did_you_mean(str(value), map(str, choices))};"
                f" choose one of {', '.join(map(str, choices))}"
            )
        return value
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        args = [a for a in members if a is not type(None)]
        if type(None) in members and (
            value is None or (from_cli and value.lower() in ("none", "null"))
        ):
            return None
        if len(args) == 1:  # X | None: X's own message (did-you-mean for a Literal)
            return coerce(value, args[0], key)
        for arg in args:
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue  # A later member may accept it; none accepting is reported below
        expected = " or ".join(map(_choices_name, args))
        raise ConfigError(f"config key '{key}' must be {expected}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_cli:
            value = _parse_cli_list(value, key)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return [coerce(v, item_tp, key) for v in value]
    if tp is bool:
        if from_cli and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif tp is int:
        if from_cli:
            value = _parse_number(value, int)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if from_cli:
            value = _parse_number(value, float)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:  # a TOML table; on the command line, inside a list: '[{path="a"}]'
        if isinstance(value, dict):
            return value
    else:
        raise TypeError(f"config key '{key}': unsupported field type {tp!r}")
    raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")


def _parse_number(text: str, tp: type) -> Any:
    try:
        return tp(text)
    except ValueError:
        return text  # reported by the caller as the wrong type


LIST_SYNTAX = 'a,b or a TOML array such as \'["a", "b"]\''
"""How a list is written on the command line (``--help`` and errors say it)."""


def _parse_cli_list(text: str, key: str) -> Any:
    """A command-line list: ``a,b``, a TOML array, or ``[a, b]`` (bare words, no quotes)."""
    text = text.strip()
    if not text.startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        inner = text[1:-1] if text.endswith("]") else "["  # unclosed: not bare words
        if not any(c in inner for c in "[]{}\"'="):
            return _parse_cli_list(inner, key)
        raise ConfigError(
            f"config key '{key}' cannot be read as a list from {text!r}: write {LIST_SYNTAX}, "
            "quoting the strings inside brackets"
        ) from e


def build_section(cls: type, section: str, values: dict[str, Any]) -> Any:
    """Instantiate config dataclass ``cls`` from ``values``, checking keys and types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(
                f"unknown config key '{section}.{key}'{did_you_mean(key, fields)}; "
                f"[{section}] has: {', '.join(sorted(fields))}"
            )
        kwargs[key] = coerce(value, hints[key], f"{section}.{key}")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(f"config key '{section}.{e.key}' {e.message}") from None


@functools.cache
def _class_body(cls: type) -> list[ast.stmt]:
    return ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (for ``--help``)."""
    docs = {}
    for node, nxt in itertools.pairwise(_class_body(cls)):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def section_doc(cls: type) -> str:
    """The class docstring of config dataclass ``cls``, on one line; "" when it has none.

    Read from the source: ``cls.__doc__`` of a dataclass without a docstring is its signature.
    """
    body = _class_body(cls)
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return " ".join(first.value.value.split())
    return ""


def help_type(f: dataclasses.Field, tp: Any) -> str:
    """A field's type for ``--help``; fixed choices are listed (``one of 'a', 'b'``)."""
    choices = f.metadata.get("choices")
    if choices is None and typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
    if choices is not None:
        return f"one of {', '.join(map(repr, choices))}"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(
            "None" if a is type(None) else _choices_name(a) for a in typing.get_args(tp)
        )
    if typing.get_origin(tp) is list:
        return f"list of {_choices_name(typing.get_args(tp)[0])}"
    return _type_name(tp)
