"""The Llama family: args and flavors, the transformer, its TP plan, HF format and memory.

``LLAMA`` is its :class:`~plugtrain.model.spec.ModelSpec` (``llama/spec.py``). This door is lazy,
as the others: the config reads the flavors (``llama/args.py``) without importing torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.model.llama.spec import LLAMA as LLAMA
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
