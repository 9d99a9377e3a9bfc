"""An example third-party backend: registers an RMSNorm implementation.

It uses exactly the public plugin path our own backends use: an entry point in the
group ``tokamax.backends`` pointing at a `tokamax.plugin.Backend`, which names the
kernel classes lazily.
"""

import tokamax

BACKEND = tokamax.plugin.Backend(
    name="example",
    api_version=tokamax.plugin.PLUGIN_API_VERSION,
    implementations=(
        tokamax.plugin.Implementation(
            op="layer_norm",
            name="example_rms",
            forward="tokamax_example_plugin.rms_norm:ExampleRmsNorm",
            backward="tokamax_example_plugin.rms_norm:ExampleRmsNormVjp",
            platforms=("cpu", "gpu", "tpu"),
            # Below the XLA reference: used only when asked for by name.
            priority=-5,
        ),
    ),
)
