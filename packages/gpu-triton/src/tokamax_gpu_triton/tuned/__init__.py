"""Tuned configs of this backend, ``<device_kind_slug>/<op>.json``.

Written on the device itself by ``python -m tokamax autotune --out
packages/gpu-triton/src/tokamax_gpu_triton/tuned``; read by tokamax-core (data
only, never imported code) when ``implementation=None``.
"""
