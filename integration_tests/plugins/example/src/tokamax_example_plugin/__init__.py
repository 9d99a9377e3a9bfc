"""An example third-party backend: registers an RMSNorm implementation.

It uses exactly the public plugin path our own backends use: an entry point in the
group ``tokamax.backends`` pointing at a `tokamax.plugin.Backend`, which names the
kernel classes lazily.
"""

import tokamax

BACKEND = tokamax.plugin.Backend(
    name="example",
    # The plugin API version this package was written against, as a literal (not
    # tokamax.plugin.PLUGIN_API_VERSION, which would always match the installed
    # core): a core that speaks another version then refuses it with a warning.
    api_version=1,
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
