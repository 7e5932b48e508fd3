"""plugtrain: a PyTorch-native LLM trainer whose loop fires pluggy hooks that plugins implement.

Plugins import :mod:`plugtrain.plugin` (the public plugin API); the hooks are declared and
documented in :mod:`plugtrain.hookspecs`.
"""

__version__ = "0.1.0"

PROJECT_NAME = "plugtrain"
"""pluggy's project name, which marks the hook specs and implementations (here, free of torch,
for the host; plugins read it from :mod:`plugtrain.plugin`)."""

API_VERSION = (1, 0)
"""The version of the plugin API, ``(major, minor)``: :mod:`plugtrain.plugin`, which re-exports
it, and the hooks of :mod:`plugtrain.hookspecs`. A minor version adds (hooks, arguments, names)
and may deprecate: a renamed hook or argument keeps working, with a ``DeprecationWarning``, for
one minor version. A major version removes or changes something a plugin uses. Every change a
plugin author must act on is listed in the repository's ``CHANGELOG.md``. A plugin that needs a
feature checks ``API_VERSION >= (1, 1)``."""
