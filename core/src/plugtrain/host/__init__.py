"""The plugin system: discovery of installed plugins and the host that registers and calls them."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "plugin_host": ["Implementation", "PluginHost", "installed_plugins"],
    },
)
