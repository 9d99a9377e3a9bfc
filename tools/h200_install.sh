# Sourced by the device scripts: installs the carried wheels and every package.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  ./packages/xla-reference ./packages/core ./packages/gpu-triton ./packages/gpu-mosaic \
  ./packages/tpu-mosaic ./integration_tests/plugins/example 2>&1 | tail -3
