# Sourced by the device scripts: installs the carried wheels and every package.
# The device machine reaches no package index: hatchling and its dependencies come
# as wheels in .whl/ (built or downloaded on a CPU machine), JAX is the machine's own.
# The packages name each other by version range (as published); --no-deps skips
# pip's resolution, so the last step checks those ranges among what got installed.
export PYTHONUNBUFFERED=1
SITE=${TOKAMAX_SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl || return 1 2>/dev/null || exit 1
export PYTHONPATH=$SITE
python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  ./packages/xla-reference ./packages/core ./packages/gpu-triton ./packages/gpu-mosaic \
  ./packages/tpu-mosaic ./integration_tests/plugins/example || return 1 2>/dev/null || exit 1
python3 - <<'EOF' || return 1 2>/dev/null || exit 1
import importlib.metadata as md
from packaging.requirements import Requirement
ours = {d.metadata["Name"]: d for d in md.distributions() if d.metadata["Name"].startswith("tokamax")}
bad = [f"{name} {d.version} requires {r}" for name, d in ours.items()
       for r in map(Requirement, d.requires or []) if r.name in ours
       and r.marker is None and not r.specifier.contains(ours[r.name].version)]
print("installed:", ", ".join(f"{n} {d.version}" for n, d in sorted(ours.items())))
if bad:
  raise SystemExit("version ranges not met: " + "; ".join(bad))
EOF
