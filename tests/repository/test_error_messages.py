"""User-error messages are worded alike: one line, the culprit, then the fix, no trailing period.

Read from the source, not raised: every message a user error (``UserError`` and its subclasses,
``check_field``) is built with, in the core and the plugins, is checked as written, its
f-string placeholders standing for the values.
"""

from __future__ import annotations

import ast
from pathlib import Path

ERRORS = {
    "UserError",
    "ConfigError",
    "FieldError",
    "PluginError",
    "DataError",
    "MissingFileError",
    "CheckpointError",
    "DumpFolderError",
}
COMPOSED = {"problem", "e.message", "message"}
"""Placeholders that hold a whole message written (and checked) elsewhere."""


def _text(node: ast.expr) -> str | None:
    """The message ``node`` builds, ``{...}`` for each placeholder; None if not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
            for v in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def user_error_messages(repo: Path) -> list[tuple[str, str]]:
    """Every literal message of a user error in the core and the plugins, with its place."""
    files = [*repo.glob("core/src/**/*.py"), *repo.glob("plugins/*/src/**/*.py")]
    found = []
    for file in sorted(files):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", "")
            if name in ERRORS:
                arg = node.args[-1]  # FieldError(key, message)
            elif name == "check_field" and len(node.args) == 3:
                arg = node.args[2]
            else:
                continue
            text = _text(arg)
            if text is not None:
                found.append((f"{file.relative_to(repo)}:{node.lineno}", text))
    return found


def wording_problem(text: str) -> str:
    """What breaks the rule in message ``text`` ("" if nothing): one line, no trailing period,
    a fix after ``: `` or ``; `` (a range, ``must be >= 1, got 0``, is its own fix), bounds
    written ``>=``."""
    if "\n" in text:
        return "spans several lines"
    if text.rstrip().endswith("."):
        return "ends with a period"
    if "at least 1" in text:
        return "says 'at least 1' where the others say '>= 1'"
    if text.strip("{}") in COMPOSED or text.endswith(tuple(f"{{{c}}}" for c in COMPOSED)):
        return ""
    if not any(mark in text for mark in (": ", "; ", "must ")):
        return "gives no fix (after ': ' or '; ')"
    return ""


def test_every_user_error_message_is_one_line_culprit_then_fix(repo):
    messages = user_error_messages(repo)
    assert len(messages) > 200  # the walk found them: a rule that checks nothing cannot fail
    problems = [
        f"{place}: {why}: {text}" for place, text in messages if (why := wording_problem(text))
    ]
    assert problems == []


def test_the_wording_rule_refuses_what_it_names():
    assert wording_problem("config key 'training.steps' must be >= 1, got {value}") == ""
    assert wording_problem("job.dump_folder {folder} is a file: set it to a folder") == ""
    assert wording_problem("something failed.") == "ends with a period"
    assert wording_problem("first line\nsecond line: fix") == "spans several lines"
    assert wording_problem("{plugin} is not a registered plugin") == (
        "gives no fix (after ': ' or '; ')"
    )
    assert wording_problem("steps must be at least 1, got 0").startswith("says 'at least 1'")
