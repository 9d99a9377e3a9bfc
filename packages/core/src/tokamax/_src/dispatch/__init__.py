"""Dispatch: choose an implementation per call, forward and backward separately.

The one place that turns ``implementation=`` into a running kernel:

- `candidates`: what ``implementation=`` names, in order;
- `selection`: the one loop that picks the first candidate taking a call;
- `configs`: the kernel config a chosen implementation runs with;
- `records`: what was decided (`tokamax.record_dispatch`) and who observes it;
- `call`: one op call under `jax.custom_vjp`, with `sharding` as the layer
  that partitions each direction over the devices.
"""

from tokamax._src.dispatch.call import backward_with_residuals as backward_with_residuals
from tokamax._src.dispatch.call import call as call
from tokamax._src.dispatch.call import forward_with_residuals as forward_with_residuals
from tokamax._src.dispatch.candidates import Implementation as Implementation
from tokamax._src.dispatch.candidates import check_opt_in as check_opt_in
from tokamax._src.dispatch.candidates import expand as expand
from tokamax._src.dispatch.candidates import platform_matches as platform_matches
from tokamax._src.dispatch.configs import resolve as resolve_config
from tokamax._src.dispatch.records import DispatchRecord as DispatchRecord
from tokamax._src.dispatch.records import observe as observe
from tokamax._src.dispatch.records import record_dispatch as record_dispatch

__all__ = [
    "DispatchRecord", "Implementation", "backward_with_residuals", "call",
    "check_opt_in", "expand", "forward_with_residuals", "observe", "platform_matches",
    "record_dispatch", "resolve_config",
]
