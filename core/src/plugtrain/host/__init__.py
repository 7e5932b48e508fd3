"""The plugin system: discovery of installed plugins and the host that registers and calls them."""
