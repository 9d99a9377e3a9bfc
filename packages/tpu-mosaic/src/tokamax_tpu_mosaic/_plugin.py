"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

BACKEND = plugin.Backend(
    name="tpu_mosaic",
    api_version=plugin.PLUGIN_API_VERSION,
    implementations=(),
)
