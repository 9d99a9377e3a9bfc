"""Tuned configs of this backend, ``<device_kind_slug>/<op>.json``.

Written on the device itself by ``tools/h200_retune.sh`` (``python -m tokamax
autotune`` with every GPU backend installed, so the files time the Triton and XLA
implementations too); read by tokamax-core (data only, never imported code) when
``implementation=None``.
"""
