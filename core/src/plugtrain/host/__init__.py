"""The plugin system: discovery of installed plugins and the host that registers and calls them."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.host.plugin_host import Implementation as Implementation
    from plugtrain.host.plugin_host import PluginHost as PluginHost
    from plugtrain.host.plugin_host import installed_plugins as installed_plugins
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
