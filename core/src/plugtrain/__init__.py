"""plugtrain: a PyTorch-native LLM trainer whose loop fires pluggy hooks that plugins implement.

Plugins import :mod:`plugtrain.plugin` (the public plugin API); the hooks are declared and
documented in :mod:`plugtrain.hookspecs`.
"""

__version__ = "0.1.0"
