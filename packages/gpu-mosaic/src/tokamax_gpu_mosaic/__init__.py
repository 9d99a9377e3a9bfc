"""tokamax-gpu-mosaic: a tokamax backend package (registered through the `tokamax.backends` entry point)."""

__version__ = "0.1.0"
