"""A backend declaring a plugin API version from the future."""

import tokamax

BACKEND = tokamax.plugin.Backend(
    name="future",
    api_version=tokamax.plugin.PLUGIN_API_VERSION + 1,
    implementations=(
        tokamax.plugin.Implementation(
            op="layer_norm", name="future_norm",
            forward="tokamax_future_plugin.kernels:FutureNorm",
            platforms=("cpu", "gpu", "tpu")),
    ),
)
