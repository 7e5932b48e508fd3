"""The mixture-of-experts family (Qwen3-MoE layout).

Its args and flavors, the router and experts, the model, its Hugging Face format and memory.

``MOE`` is its :class:`~plugtrain.model.spec.ModelSpec` (``moe/spec.py``). This door is lazy,
as the others: the config reads the flavors (``moe/args.py``) without importing torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.model.moe.args import FLAVORS as FLAVORS
    from plugtrain.model.moe.args import MoEArgs as MoEArgs
    from plugtrain.model.moe.experts import GroupedExperts as GroupedExperts
    from plugtrain.model.moe.layer import MoE as MoE
    from plugtrain.model.moe.layer import Router as Router
    from plugtrain.model.moe.layer import RouterStats as RouterStats
    from plugtrain.model.moe.spec import MOE as MOE
    from plugtrain.model.moe.transformer import MoEBlock as MoEBlock
    from plugtrain.model.moe.transformer import MoETransformer as MoETransformer
    from plugtrain.model.moe.transformer import moe_layers as moe_layers
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
