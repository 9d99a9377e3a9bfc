"""Tuned data over a grid of shapes: the nearest-point rule, the training step's
choice by forward + own backward time, and `autotune --grid`."""

import importlib.resources
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import bench_suite
from tokamax._src import dispatch
from tokamax._src.ops import catalog
from tokamax._src.tuning import nearest
from tokamax._src.tuning import results
from tokamax._src.tuning import shipped
from tokamax._src.tuning import trials

_ATTN = ("query=bfloat16[{b},{t},16,128] key=bfloat16[{b},{t},16,128] "
         "value=bfloat16[{b},{t},16,128] scale=0.088 is_causal={c}")


def _attn(b=8, t=4096, c=True, dtype="bfloat16"):
  return _ATTN.format(b=b, t=t, c=c).replace("bfloat16", dtype)


def _attention_call(b: int, t: int) -> tokamax.AttentionArgs:
  """The call whose key is `_attn(b, t)` (bf16, 16 heads of 128, causal)."""
  q = jax.ShapeDtypeStruct((b, t, 16, 128), jnp.bfloat16)
  return tokamax.AttentionArgs(q, q, q, scale=0.088, is_causal=True)


def _attention_times(times: dict) -> results.AutotuningResult:
  """An attention result from ``{key: {direction: {implementation: ms}}}``."""
  return results.AutotuningResult(
      [results.Measurement("dot_product_attention", direction, key, impl, None, ms)
       for key, by_direction in times.items()
       for direction, by_impl in by_direction.items()
       for impl, ms in by_impl.items()], device_kind="cpu")


def test_parse_separates_what_must_match_from_the_sizes():
  kind, numbers = nearest.parse(
      _attn(2, 8192) + " local_window=(1024, 0)")
  assert numbers == (2, 8192, 16, 128) * 3 + (1024, 0)
  assert ("is_causal", "True") in kind and ("local_window", "ints", 2) in kind
  assert ("scale", "float") in kind  # its value is not compared
  assert nearest.parse(_attn(dtype="float16"))[0] == nearest.parse(_attn())[0]
  assert nearest.parse(_attn(dtype="float32"))[0] != nearest.parse(_attn())[0]


def test_nearest_is_by_the_largest_octave_then_the_total():
  grid = [_attn(32, 1024), _attn(8, 4096), _attn(2, 16384)]
  assert nearest.nearest(_attn(4, 4096), grid) == _attn(8, 4096)
  assert nearest.nearest(_attn(1, 16384), grid) == _attn(2, 16384)
  # B1 T4096: 3 octaves from B8 T4096 in B; B2 T16384 is 1 in B and 2 in T.
  assert nearest.nearest(_attn(1, 4096), grid) == _attn(2, 16384)
  assert nearest.nearest(_attn(8, 4096), grid) == _attn(8, 4096)  # exact
  # Farther than 4x on some size: nothing.
  assert nearest.nearest(_attn(8, 128), grid) is None
  assert nearest.nearest(_attn(8, 4096), grid, radius=0.5) == _attn(8, 4096)


def test_nearest_keeps_to_calls_of_the_same_kind():
  grid = [_attn(8, 4096, c=True)]
  assert nearest.nearest(_attn(8, 4096, c=False), grid) is None
  assert nearest.nearest(_attn(8, 4096, dtype="float32"), grid) is None
  assert nearest.nearest(_attn(8, 4096) + " local_window=(1024, 0)", grid) is None
  assert nearest.nearest(_attn(8, 4096, dtype="float16"), grid) == grid[0]
  # Windows far apart on the other side are different windows.
  windowed = [_attn() + " local_window=(1024, 0)"]
  assert nearest.nearest(_attn() + " local_window=(2048, 0)", windowed) == windowed[0]
  assert nearest.nearest(_attn() + " local_window=(0, 1024)", windowed) is None


def test_grouped_heads_and_cross_attention_are_other_kinds():
  gqa = _attn().replace("key=bfloat16[8,4096,16,128]", "key=bfloat16[8,4096,4,128]")
  gqa = gqa.replace("value=bfloat16[8,4096,16,128]", "value=bfloat16[8,4096,4,128]")
  assert nearest.nearest(gqa, [_attn()]) is None
  assert nearest.nearest(_attn(), [gqa]) is None
  cross = _attn().replace("key=bfloat16[8,4096,", "key=bfloat16[8,2048,")
  cross = cross.replace("value=bfloat16[8,4096,", "value=bfloat16[8,2048,")
  assert nearest.nearest(cross, [_attn()]) is None
  # Another GQA ratio is the same kind (query and key differ on the same axes).
  gqa8 = gqa.replace("key=bfloat16[8,4096,4,128]", "key=bfloat16[8,4096,2,128]")
  gqa8 = gqa8.replace("value=bfloat16[8,4096,4,128]", "value=bfloat16[8,4096,2,128]")
  assert nearest.nearest(gqa8, [gqa]) == gqa


def _gqa(key: str, heads: int = 4) -> str:
  """`key` (an `_attn` key) with `heads` key and value heads of its 16."""
  for field in ("key", "value"):
    for b_t in ("8,4096", "2,8192", "8,8192"):
      key = key.replace(f"{field}=bfloat16[{b_t},16,", f"{field}=bfloat16[{b_t},{heads},")
  return key


def test_the_other_head_sharing_answers_where_its_own_has_no_call_near():
  """`nearest.KIND_FALLBACK`: attention's MHA and GQA calls answer for each
  other, only where a call's own kind has nothing within the radius, and only
  through `op_nearest_keys` (the op's rules)."""
  window = " local_window=(1024, 0)"
  mha, gqa = _attn(2, 8192) + window, _gqa(_attn(2, 8192) + window)
  op = "dot_product_attention"
  assert nearest.nearest(mha, [gqa]) is None  # kinds apart without the op's rule
  assert nearest.op_nearest_keys(op, mha, [gqa]) == [gqa]
  assert nearest.op_nearest_keys(op, gqa, [mha]) == [mha]
  # Its own kind within the radius answers, though the other kind is nearer
  # (8 key heads of 16: 0.9 octave; B8 against B2: 1.6).
  own, gqa8 = _attn(8, 8192) + window, _gqa(_attn(2, 8192) + window, heads=8)
  assert nearest.op_nearest_keys(op, mha, [gqa8]) == [gqa8]
  assert nearest.op_nearest_keys(op, mha, [gqa8, own]) == [own]
  # Beyond the radius the other kind says nothing either.
  assert nearest.op_nearest_keys(op, _attn(2, 128) + window, [gqa]) == []
  # The forward's head dim first holds there too: of the other kind, B8 H128
  # (1.6 octaves away) before B2 H64 (1).
  gqa_b8, gqa_h64 = _gqa(_attn(8, 8192) + window), _gqa(_attn(2, 8192) + window)
  gqa_h64 = gqa_h64.replace(",128]", ",64]")
  head_dim = nearest.same_size_first(op, "forward")
  assert nearest.op_nearest_keys(op, mha, [gqa_b8, gqa_h64]) == [gqa_h64]
  assert nearest.op_nearest_keys(op, mha, [gqa_b8, gqa_h64], head_dim) == [gqa_b8]
  # Only the head axis may differ: cross-attention (T != S) stays apart.
  cross = gqa.replace("key=bfloat16[2,8192,", "key=bfloat16[2,4096,").replace(
      "value=bfloat16[2,8192,", "value=bfloat16[2,4096,")
  assert nearest.op_nearest_keys(op, mha, [cross]) == []
  # Nor does another op take it (its kinds stay apart).
  assert nearest.op_nearest_keys("layer_norm", mha, [gqa]) == []


def test_nearest_ties_do_not_depend_on_order():
  a, b = _attn(4, 4096), _attn(16, 4096)
  assert nearest.nearest(_attn(8, 4096), [a, b]) == nearest.nearest(_attn(8, 4096), [b, a])


def test_a_call_halfway_between_grid_points_takes_both():
  """B2 T8192 is one octave from B2 T4096 and from B2 T16384: equally near up
  to the +1 in the distance, so both answer, nearest first."""
  grid = [_attn(2, 16384), _attn(2, 4096), _attn(8, 4096)]
  assert nearest.nearest_keys(_attn(2, 8192), grid) == [_attn(2, 4096), _attn(2, 16384)]
  assert nearest.nearest(_attn(2, 8192), grid) == _attn(2, 4096)
  # Nearer to one by more than `nearest.TIE`: that one alone.
  assert nearest.nearest_keys(_attn(2, 6144), grid) == [_attn(2, 4096)]
  assert nearest.nearest_keys(_attn(2, 4096), grid) == [_attn(2, 4096)]
  assert nearest.nearest_keys(_attn(2, 128), grid) == []
  # One octave in the head dim is as far as one in T by the largest distance,
  # but three times as far in total (query, key and value): not a tie.
  h64 = _attn(2, 4096).replace(",128]", ",64]")
  assert nearest.nearest_keys(_attn(2, 8192), grid + [h64]) == [_attn(2, 4096),
                                                               _attn(2, 16384)]


def test_blend_is_the_geometric_mean_of_what_every_point_measured():
  blended = nearest.blend([{"cudnn": 1.0, "mosaic_gpu": 0.5, "triton": 2.0},
                           {"cudnn": 16.0, "mosaic_gpu": 32.0}])
  assert blended == pytest.approx({"cudnn": 4.0, "mosaic_gpu": 4.0})  # no triton
  inf = float("inf")
  assert nearest.blend([{"xla": 1.0, "cudnn": inf},
                        {"xla": 4.0, "cudnn": 1.0}]) == {"xla": 2.0, "cudnn": inf}
  # Failed at one point and not measured at the other: still tried last.
  assert nearest.blend([{"mosaic_gpu": 1.0, "cudnn": inf},
                        {"mosaic_gpu": 4.0, "triton": 5.0}]) == {"mosaic_gpu": 2.0,
                                                                 "cudnn": inf}
  # Nothing measured at every point: the nearest point's times.
  assert nearest.blend([{"xla": 3.0}, {"cudnn": 1.0}]) == {"xla": 3.0}
  assert nearest.blend([{"xla": 3.0}]) == {"xla": 3.0}
  assert nearest.blend([]) == {}


def test_a_call_between_grid_points_ranks_by_both():
  """mosaic_gpu is 1% faster at B2 T4096, cuDNN 11% faster at B2 T16384 (the H200
  backward, notes/MEASUREMENTS.md session 54): at B2 T8192 between them, the
  blend ranks cuDNN first where the nearer point alone ranked mosaic_gpu."""
  near, far = _attn(2, 4096), _attn(2, 16384)
  result = _attention_times({
      near: {"forward": {"cudnn": 0.48, "mosaic_gpu": 0.44},
             "backward": {"cudnn": 1.46, "mosaic_gpu": 1.45}},
      far: {"forward": {"cudnn": 6.5, "mosaic_gpu": 6.3},
            "backward": {"cudnn": 20.9, "mosaic_gpu": 23.5}}})
  call = _attention_call(2, 8192)
  backward = result.measured_times("dot_product_attention", "backward", call)
  assert backward == pytest.approx({"cudnn": (1.46 * 20.9) ** 0.5,
                                    "mosaic_gpu": (1.45 * 23.5) ** 0.5})
  assert min(backward, key=backward.get) == "cudnn"
  step = result.step_times("dot_product_attention", call)
  assert step == pytest.approx({"cudnn": ((0.48 + 1.46) * (6.5 + 20.9)) ** 0.5,
                                "mosaic_gpu": ((0.44 + 1.45) * (6.3 + 23.5)) ** 0.5})
  assert min(step, key=step.get) == "cudnn"


def test_the_attention_forward_takes_data_of_its_own_head_dim_first():
  """Its ranking follows the head dim (`nearest.SAME_SIZE_FIRST`): a grid point
  of the call's head dim if one is within the radius, else the nearest of any;
  the backward takes the nearest of any head dim."""
  h64 = _attn().replace(",128]", ",64]")
  assert nearest.parse(h64)[0] == nearest.parse(_attn())[0]
  forward = nearest.same_size_first("dot_product_attention", "forward")
  # H64 is nearer (1 octave in H) than B2 T16384 (2 in T), but of another H.
  assert nearest.nearest(_attn(4, 4096), [h64, _attn(2, 16384)]) == h64
  assert nearest.nearest(_attn(4, 4096), [h64, _attn(2, 16384)],
                         same_first=forward) == _attn(2, 16384)
  # No H128 point within the radius: the nearest of any H.
  assert nearest.nearest(_attn(4, 4096), [h64, _attn(32, 1024)], radius=1.5,
                         same_first=forward) == h64
  h96 = _attn().replace(",128]", ",96]")  # a head dim off the grid
  assert nearest.nearest(h96, [h64, _attn()], same_first=forward) == _attn()
  backward = nearest.same_size_first("dot_product_attention", "backward")
  assert nearest.nearest(_attn(4, 4096), [h64, _attn(2, 16384)],
                         same_first=backward) == h64
  assert nearest.same_size_first("ragged_dot", "forward") == ()


def test_step_times_come_from_one_point_measured_both_ways():
  """Off the grid, the forward's nearest point (of the call's head dim) and the
  step's (of any) differ: the step adds one point's forward and backward."""
  h64, h128 = _attn(8, 4096).replace(",128]", ",64]"), _attn(2, 16384)
  result = _attention_times({
      h64: {"forward": {"cudnn": 1.0, "mosaic_gpu": 2.0},
            "backward": {"cudnn": 4.0, "mosaic_gpu": 2.0}},
      h128: {"forward": {"cudnn": 9.0, "mosaic_gpu": 8.0},
             "backward": {"cudnn": 1.0, "mosaic_gpu": 9.0}}})
  call = _attention_call(8, 4096)  # the H64 point's sizes at H128
  assert results.args_key(call) == _attn(8, 4096)
  assert result.measured_times("dot_product_attention", "forward", call) == {
      "cudnn": 9.0, "mosaic_gpu": 8.0}  # H128's (2 octaves away), not H64's
  assert result.measured_times("dot_product_attention", "backward", call) == {
      "cudnn": 4.0, "mosaic_gpu": 2.0}  # the nearest: H64's (1 octave)
  assert result.step_times("dot_product_attention", call) == {
      "cudnn": 5.0, "mosaic_gpu": 4.0}  # H64's both ways, not a mix of points


class _MeasuredOnly:
  """A config source with `measured_times` and no `step_times`."""

  def __init__(self, times: dict):
    self.times = times

  def lookup(self, op, args):
    return None

  def measured_times(self, op_name, direction, args):
    return self.times.get(direction, {})


def test_step_times_ask_the_innermost_source_that_has_them():
  from tokamax._src.tuning import context, sources
  outer = _MeasuredOnly({"forward": {"xla": 1.0, "cudnn": 2.0},
                         "backward": {"xla": 4.0, "cudnn": 1.0}})
  forward_only = _MeasuredOnly({"forward": {"xla": 9.0}})
  with context.use(outer):
    # A source without step_times: its two directions added up.
    assert sources.step_times("dot_product_attention", None) == {"xla": 5.0,
                                                                 "cudnn": 3.0}
    with context.use(forward_only):
      # One without a backward has no step: the next source answers, whole.
      assert sources.step_times("dot_product_attention", None) == {"xla": 5.0,
                                                                   "cudnn": 3.0}
      assert sources.measured_times("dot_product_attention", "forward", None) == {
          "xla": 9.0}


def _q(t):
  return jnp.asarray(np.random.default_rng(0).standard_normal((1, t, 2, 8)), jnp.float32)


def _key(q):
  seen = []
  with dispatch.observe(lambda op, args, impl: seen.append(args)):
    tokamax.dot_product_attention(q, q, q)
  return seen[0]


def _result(q, times: dict) -> results.AutotuningResult:
  key = results.args_key(_key(q))
  return results.AutotuningResult(
      [results.Measurement("dot_product_attention", direction, key, impl, None, ms)
       for (direction, impl), ms in times.items()], device_kind="cpu")


def test_measured_times_of_a_call_off_the_grid_are_its_nearest_ones():
  result = _result(_q(48), {("forward", "xla_chunked"): 1.0, ("forward", "xla"): 5.0})
  assert result.measured_times("dot_product_attention", "forward", _key(_q(64))) == {
      "xla_chunked": 1.0, "xla": 5.0}
  assert result.measured_times("dot_product_attention", "forward", _key(_q(400))) == {}
  with result, tokamax.record_dispatch() as records:
    tokamax.dot_product_attention(_q(64), _q(64), _q(64))
  assert records[0].implementation == "xla_chunked"


def _ragged_key(m, k, n, g):
  return (f"lhs=bfloat16[{m},{k}] rhs=bfloat16[{g},{k},{n}] "
          f"group_sizes=int32[{g}]")


def test_ragged_dot_data_transfers_half_an_octave():
  """Its rankings flip within an octave (G128 K4096 N1536 -> G160 K5120 N1536):
  farther calls keep the registry's order, attention's data still reaches 4x."""
  grid = [_ragged_key(65536, 4096, 1536, 128)]
  assert nearest.radius_for("ragged_dot") == 0.5
  assert nearest.radius_for("dot_product_attention") == nearest.RADIUS == 2.0
  result = results.AutotuningResult(
      [results.Measurement("ragged_dot", "forward", grid[0], "triton", None, 1.0),
       results.Measurement("ragged_dot", "forward", grid[0], "mosaic_gpu", None, 1.1)],
      device_kind="cpu")
  s = jax.ShapeDtypeStruct

  def args(m, k, n, g):
    return tokamax.RaggedDotArgs(lhs=s((m, k), jnp.bfloat16),
                                 rhs=s((g, k, n), jnp.bfloat16),
                                 group_sizes=s((g,), jnp.int32))
  assert results.args_key(args(65536, 4096, 1536, 128)) == grid[0]
  # 0.42 octave away (M 49152): the grid point's times.
  assert result.measured_times("ragged_dot", "forward", args(49152, 4096, 1536, 128)) == {
      "triton": 1.0, "mosaic_gpu": 1.1}
  # 0.68 octave (M) away: none.
  assert result.measured_times("ragged_dot", "forward", args(40960, 5120, 1536, 160)) == {}


def test_attention_lengths_no_multiple_of_128_take_only_their_own_kind():
  """Mosaic GPU runs other kernels where T or S is no multiple of 128, and
  copies its inputs padded where they are no multiple of 8
  (`nearest.TILE_ALIGNED`): calls of these kinds do not answer for each other,
  however near."""
  aligned = nearest.tile_aligned("dot_product_attention")
  grid = [_attn(8, 4096), _attn(8, 2000)]
  assert nearest.nearest(_attn(8, 4000), grid) == _attn(8, 4096)  # without the rule
  assert nearest.nearest(_attn(8, 4000), grid, aligned=aligned) == _attn(8, 2000)
  assert nearest.nearest(_attn(8, 3968), grid, aligned=aligned) == _attn(8, 4096)
  assert nearest.nearest(_attn(8, 4000), grid[:1], aligned=aligned) is None
  result = _attention_times({
      _attn(8, 4096): {"forward": {"mosaic_gpu": 1.0, "cudnn": 1.1}},
      _attn(8, 2000): {"forward": {"mosaic_gpu": 0.6, "cudnn": 0.5}}})
  times = result.measured_times("dot_product_attention", "forward",
                                _attention_call(8, 3000))
  assert times == {"mosaic_gpu": 0.6, "cudnn": 0.5}
  assert result.measured_times("dot_product_attention", "forward",
                               _attention_call(8, 3968)) == {"mosaic_gpu": 1.0, "cudnn": 1.1}
  # A length no multiple of 8 (Mosaic GPU copies its inputs padded) is a third
  # kind: no data here, so dispatch keeps the registry's order.
  assert nearest.nearest(_attn(8, 2004), grid, aligned=aligned) is None
  assert result.measured_times("dot_product_attention", "forward",
                               _attention_call(8, 2004)) == {}
  # Cross-attention with only the key length unaligned is a kind of its own.
  def cross(s):
    return _attn(8, 4096).replace("key=bfloat16[8,4096,", f"key=bfloat16[8,{s},").replace(
        "value=bfloat16[8,4096,", f"value=bfloat16[8,{s},")
  assert nearest.nearest(cross(4000), [cross(8192)]) == cross(8192)  # without the rule
  assert nearest.nearest(cross(4000), [cross(8192)], aligned=aligned) is None
  assert nearest.nearest(cross(4000), [cross(8192), cross(2000)],
                         aligned=aligned) == cross(2000)
  assert nearest.tile_aligned("ragged_dot") is None


def test_norm_widths_with_a_tail_take_only_their_own_kind():
  """Past whole 1024-column pieces the Mosaic GPU norms run tail pieces and
  Triton's pads its blocks (`nearest.TILE_ALIGNED`): a width of another kind
  is no answer for them, however near; without data of their own they keep
  the registry's order."""
  def norm(r, d):
    return (f"x=bfloat16[{r},{d}] scale=bfloat16[{d}] offset=bfloat16[{d}] "
            "epsilon=1e-06 subtract_mean=True")
  aligned = nearest.tile_aligned("layer_norm")
  grid = [norm(8192, 4096), norm(8192, 2304)]
  assert nearest.nearest(norm(8192, 3584), grid) == norm(8192, 4096)  # without the rule
  assert nearest.nearest(norm(8192, 3584), grid, aligned=aligned) == norm(8192, 2304)
  assert nearest.nearest(norm(8192, 3584), grid[:1], aligned=aligned) is None
  assert nearest.nearest(norm(8192, 5120), grid, aligned=aligned) == norm(8192, 4096)
  # A width no multiple of 128 (no Mosaic GPU kernel) is a third kind.
  assert nearest.nearest(norm(8192, 3000), grid, aligned=aligned) is None
  def call(d):
    s = jax.ShapeDtypeStruct
    return tokamax.LayerNormArgs(x=s((8192, d), jnp.bfloat16), scale=s((d,), jnp.bfloat16),
                                 offset=s((d,), jnp.bfloat16))
  result = results.AutotuningResult(
      [results.Measurement("layer_norm", "backward", norm(8192, 4096), impl, None, ms)
       for impl, ms in (("triton", 1.0), ("mosaic_gpu", 1.04))], device_kind="cpu")
  assert result.measured_times("layer_norm", "backward", call(5120)) == {
      "triton": 1.0, "mosaic_gpu": 1.04}
  assert result.measured_times("layer_norm", "backward", call(3584)) == {}


def test_attention_backward_off_a_power_of_two_of_key_blocks_takes_the_unaligned_kind():
  """Mosaic GPU's attention backward without causal masking at H128 (and MHA
  at H64) ranks as the grid's powers of two measure it only at a power of two
  of 128-key blocks (`nearest.POWERS_OF_TWO`): at other multiples of 128 its
  backward and the step take the data of lengths no multiple of 128; its
  forward, and the calls whose backward does not change there, the aligned
  data."""
  def mqa(b, t, causal=False, n=8, k=1, h=128, s=None):
    s = t if s is None else s
    return (f"query=bfloat16[{b},{t},{n},{h}] key=bfloat16[{b},{s},{k},{h}] "
            f"value=bfloat16[{b},{s},{k},{h}] scale=0.088 is_causal={causal}")
  def call(b, t, causal=False, n=8, k=1, h=128, s=None):
    s, struct = t if s is None else s, jax.ShapeDtypeStruct
    return tokamax.AttentionArgs(struct((b, t, n, h), jnp.bfloat16),
                                 struct((b, s, k, h), jnp.bfloat16),
                                 struct((b, s, k, h), jnp.bfloat16), scale=0.088,
                                 is_causal=causal)
  one_kernel = {"forward": {"mosaic_gpu": 1.0, "cudnn": 1.1},
                "backward": {"mosaic_gpu": 3.0, "cudnn": 3.1}}
  two_kernels = {"forward": {"mosaic_gpu": 1.2, "cudnn": 1.1},
                 "backward": {"mosaic_gpu": 3.5, "cudnn": 3.0}}
  for n, k, h in ((8, 1, 128), (16, 16, 128), (16, 16, 64)):
    result = _attention_times({mqa(2, 16384, n=n, k=k, h=h): one_kernel,
                               mqa(2, 15000, n=n, k=k, h=h): two_kernels})
    # 122 blocks of 128 keys: the two-kernel backward's data.
    off = call(1, 15616, n=n, k=k, h=h)
    assert result.measured_times("dot_product_attention", "backward", off) == (
        two_kernels["backward"])
    assert result.step_times("dot_product_attention", off) == {"mosaic_gpu": 4.7,
                                                               "cudnn": 4.1}
    assert result.measured_times("dot_product_attention", "forward", off) == (
        one_kernel["forward"])
    # 128 blocks: the one-kernel data.
    on = call(1, 16384, n=n, k=k, h=h)
    assert result.measured_times("dot_product_attention", "backward", on) == (
        one_kernel["backward"])
  # Cross-attention: the key length decides (the one-kernel backward at 16
  # blocks of keys, whatever the query length).
  result = _attention_times({mqa(2, 8192, s=4096): one_kernel,
                             mqa(2, 8000, s=4000): two_kernels})
  for t, s, times in ((6144, 4096, one_kernel), (8192, 3072, two_kernels)):
    assert result.measured_times("dot_product_attention", "backward",
                                 call(2, t, s=s)) == times["backward"]
  # Causal masking (its backward the same at any count of key blocks) and GQA
  # at H64 (the two-kernel backward throughout): aligned.
  for n, k, h, causal in ((16, 16, 128, True), (8, 1, 128, True), (8, 1, 64, False)):
    result = _attention_times({mqa(2, 16384, causal, n, k, h): one_kernel,
                               mqa(2, 15000, causal, n, k, h): two_kernels})
    assert result.measured_times("dot_product_attention", "backward",
                                 call(1, 15616, causal, n, k, h)) == one_kernel["backward"]


def _glu_call(m: int) -> tokamax.GatedLinearUnitArgs:
  s = jax.ShapeDtypeStruct
  return tokamax.GatedLinearUnitArgs(x=s((m, 4096), jnp.bfloat16),
                                     weights=s((4096, 2, 14336), jnp.bfloat16),
                                     activation=jax.nn.silu)


def test_whole_tile_kernels_pay_for_the_padding_of_the_call_s_rows():
  """The Mosaic GPU GLU forward computes whole tiles of 128 rows
  (`nearest.WHOLE_TILES`): from a grid point at M1024 to a call at M1025 (9
  tiles of work instead of 8 for 1/1024 more rows) its time grows by 1152/1025
  against the others', which stay as measured; at M1152 (9 whole tiles) it
  stays too, and from a point at M1025 to a call at M1152 it shrinks by as
  much."""
  def glu_times(m, times):
    return results.AutotuningResult(
        [results.Measurement("gated_linear_unit", direction, results.args_key(_glu_call(m)),
                             impl, None, ms)
         for (direction, impl), ms in times.items()], device_kind="cpu")
  measured = {("forward", "mosaic_gpu"): 1.0, ("forward", "composed"): 1.05,
              ("backward", "mosaic_gpu"): 2.0, ("backward", "composed"): 2.1}
  at_1024 = glu_times(1024, measured)
  forward = at_1024.measured_times("gated_linear_unit", "forward", _glu_call(1025))
  assert forward == pytest.approx({"mosaic_gpu": 1152 / 1025, "composed": 1.05})
  assert at_1024.measured_times("gated_linear_unit", "forward", _glu_call(1152)) == {
      "mosaic_gpu": 1.0, "composed": 1.05}
  # Neither the backward nor a training step (whose GLU forward runs XLA's
  # matmuls) is scaled.
  assert at_1024.measured_times("gated_linear_unit", "backward", _glu_call(1025)) == {
      "mosaic_gpu": 2.0, "composed": 2.1}
  assert at_1024.step_times("gated_linear_unit", _glu_call(1025)) == pytest.approx(
      {"mosaic_gpu": 3.0, "composed": 3.15})
  at_1025 = glu_times(1025, measured)
  assert at_1025.measured_times("gated_linear_unit", "forward", _glu_call(1152)) == (
      pytest.approx({"mosaic_gpu": 1025 / 1152, "composed": 1.05}))
  # Where it was measured, the call's own times stand.
  assert at_1025.measured_times("gated_linear_unit", "forward", _glu_call(1025)) == {
      "mosaic_gpu": 1.0, "composed": 1.05}


def test_exact_data_wins_over_nearer_kinds_of_data():
  near = _result(_q(48), {("forward", "xla_chunked"): 1.0, ("forward", "xla"): 5.0})
  exact = _result(_q(64), {("forward", "xla_chunked"): 9.0, ("forward", "xla"): 5.0})
  both = near.merge(exact)
  assert both.measured_times("dot_product_attention", "forward", _key(_q(64))) == {
      "xla_chunked": 9.0, "xla": 5.0}


def test_training_takes_the_least_forward_plus_own_backward():
  """xla_chunked's forward is measured faster, its backward much slower: inference
  runs it, a training step runs xla's forward and backward."""
  q = _q(48)
  result = _result(q, {("forward", "xla_chunked"): 1.0, ("forward", "xla"): 2.0,
                       ("backward", "xla_chunked"): 5.0, ("backward", "xla"): 1.0})
  loss = lambda q: jnp.sum(tokamax.dot_product_attention(q, q, q) ** 2)
  with result, tokamax.record_dispatch() as records:
    tokamax.dot_product_attention(q, q, q)
  assert [r.implementation for r in records] == ["xla_chunked"]
  with result, tokamax.record_dispatch() as records:
    grad = jax.grad(loss)(q)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "xla"), ("backward", "xla")]
  np.testing.assert_allclose(grad, jax.grad(loss)(q), rtol=1e-5, atol=1e-5)
  # The other way round, the step keeps the forward measured fastest.
  result = _result(q, {("forward", "xla_chunked"): 1.0, ("forward", "xla"): 2.0,
                       ("backward", "xla_chunked"): 1.0, ("backward", "xla"): 1.0})
  with result, tokamax.record_dispatch() as records:
    jax.grad(loss)(q)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "xla_chunked"), ("backward", "xla_chunked")]


def test_a_named_implementation_ignores_step_times():
  q = _q(48)
  result = _result(q, {("forward", "xla_chunked"): 1.0, ("forward", "xla"): 2.0,
                       ("backward", "xla_chunked"): 5.0, ("backward", "xla"): 1.0})
  loss = lambda q: jnp.sum(tokamax.dot_product_attention(
      q, q, q, implementation=["xla_chunked", "xla"]) ** 2)
  with result, tokamax.record_dispatch() as records:
    jax.grad(loss)(q)
  assert records[0].implementation == "xla_chunked"  # the user's order stands


def _attention_model(q):
  return jnp.sum(tokamax.dot_product_attention(q, q, q, is_causal=True) ** 2)


def test_heuristics_only_measures_one_config_per_implementation(monkeypatch):
  timed = []
  real = trials.time_ms
  monkeypatch.setattr(trials, "time_ms",
                      lambda fn, inputs, n: timed.append(fn) or real(fn, inputs, n))
  result = tokamax.autotune(_attention_model, _q(96), iterations=1, progress=False,
                            heuristics_only=True)
  impls = {(m.direction, m.implementation) for m in result.measurements}
  assert len(timed) == len(impls) and ("backward", "xla_chunked") in impls
  assert not result.failures


def test_skip_leaves_an_implementation_unmeasured():
  result = tokamax.autotune(_attention_model, _q(96), iterations=1, progress=False,
                            heuristics_only=True, skip=("xla",))
  assert {m.implementation for m in result.measurements} == {"xla_chunked"}


def test_each_backward_is_measured_on_its_own_forward(monkeypatch):
  """The residuals a backward trial gets are those of its own implementation's
  forward (what a training step gives it), not the fastest forward's."""
  seen = {}
  real = trials.trials_for

  def spy(ops, args, direction, concrete_args, fwd_state, **kw):
    if direction == "backward":
      for label, _ in ops:
        seen[label] = fwd_state(label)
    return real(ops, args, direction, concrete_args, fwd_state, **kw)
  monkeypatch.setattr(trials, "trials_for", spy)
  tokamax.autotune(_attention_model, _q(96), iterations=1, progress=False,
                   heuristics_only=True)
  assert set(seen) == {"xla", "xla_chunked"}
  # Same inputs and cotangent, residuals from each one's own forward.
  assert seen["xla"][2] is seen["xla_chunked"][2]
  assert seen["xla"][1] is not seen["xla_chunked"][1]


def test_every_op_has_grid_shapes():
  names = [p.name for p in bench_suite.grid_suite()]
  assert len(names) == len(set(names))
  assert {p.op for p in bench_suite.grid_suite()} == set(catalog.PROBLEMS)


def test_autotune_grid_writes_per_op_and_keeps_earlier_calls(monkeypatch, tmp_path):
  quick = [p for p in bench_suite.quick_suite() if p.op == "layer_norm"]
  monkeypatch.setattr(bench_suite, "grid_suite", lambda: quick)
  bench_suite.autotune_suite(None, ["rms"], str(tmp_path), 1, None, grid=True)
  bench_suite.autotune_suite(None, ["layer_norm 1024"], str(tmp_path), 1, None,
                             grid=True, skip=("xla_chunked",))
  (folder,) = tmp_path.iterdir()
  assert [f.name for f in folder.iterdir()] == ["layer_norm_grid.json"]
  data = json.loads((folder / "layer_norm_grid.json").read_text())
  keys = {m["key"] for m in data["measurements"]}
  assert len(keys) == 2  # the RMS call of the first run, the layer_norm call of the second
  assert {m["direction"] for m in data["measurements"]} == {"forward", "backward"}


def test_autotune_reference_shapes_in_two_runs_keeps_both(monkeypatch, tmp_path, capsys):
  """`autotune --shape` adds to an existing ``<op>.json`` as the grid's runs do
  (it overwrote the file, losing every other shape's configs); a run that
  measures nothing says so, exits 1 and writes nothing."""
  quick = [p for p in bench_suite.quick_suite() if p.op == "layer_norm"]
  monkeypatch.setattr(bench_suite, "reference_suite", lambda: quick)
  assert bench_suite.autotune_suite(None, ["rms"], str(tmp_path), 1, None) == 0
  assert bench_suite.autotune_suite(None, ["layer_norm 1024"], str(tmp_path), 1,
                                    None) == 0
  (folder,) = tmp_path.iterdir()
  assert [f.name for f in folder.iterdir()] == ["layer_norm.json"]
  data = json.loads((folder / "layer_norm.json").read_text())
  assert len({m["key"] for m in data["measurements"]}) == 2
  capsys.readouterr()
  every = tuple(s.name for s in tokamax.implementations("layer_norm"))
  before = (folder / "layer_norm.json").read_text()
  assert bench_suite.autotune_suite(None, ["rms"], str(tmp_path), 1, None,
                                    skip=every) == 1
  assert "autotune measured nothing" in capsys.readouterr().out
  assert (folder / "layer_norm.json").read_text() == before


def _tuning_file(versions, *entries):
  """A tuning document: entries ``(key, direction, implementation, ms)``."""
  return json.dumps(dict(
      format="tokamax-autotuning/1", device_kind="cpu", versions=versions,
      measurements=[dict(op="layer_norm", direction=d, key=k, implementation=i,
                         config={"block": 1}, time_ms=ms) for k, d, i, ms in entries]))


@pytest.mark.parametrize("suffix", ["", "_grid"])
def test_earlier_entries_kept_by_direction_and_dropped_across_versions(tmp_path, suffix):
  """A run cut short between a call's forward and its backward (--timeout) keeps
  the earlier backward; tuned configs (not the grid's) of other JAX or package
  versions are not relabelled as this run's: they are dropped."""
  loads = bench_suite.autotuning.AutotuningResult.loads
  v1 = {"jax": "0.1", "tokamax-core": "1"}
  (tmp_path / f"layer_norm{suffix}.json").write_text(_tuning_file(
      v1, ("K1", "forward", "xla", 1.0), ("K1", "backward", "xla", 1.0),
      ("K2", "forward", "xla", 1.0)))
  now = loads(_tuning_file(v1, ("K1", "forward", "xla", 2.0)))
  merged = bench_suite._with_earlier(now, str(tmp_path), "layer_norm", suffix)
  got = {(m.key, m.direction): m.time_ms for m in merged.measurements}
  assert got == {("K1", "forward"): 2.0, ("K1", "backward"): 1.0, ("K2", "forward"): 1.0}
  newer = loads(_tuning_file({"jax": "0.2", "tokamax-core": "1"},
                             ("K1", "forward", "xla", 2.0)))
  merged = bench_suite._with_earlier(newer, str(tmp_path), "layer_norm", suffix)
  kept = {(m.key, m.direction) for m in merged.measurements}
  if suffix:  # the grid ranks implementations: its other calls stay
    assert kept == {("K1", "forward"), ("K1", "backward"), ("K2", "forward")}
  else:
    assert kept == {("K1", "forward")}


def test_autotune_grid_again_keeps_the_skipped_implementations(monkeypatch, tmp_path):
  # One implementation measured again after it changed: the others' entries on
  # the same calls stay (they are what it is ranked against).
  quick = [p for p in bench_suite.quick_suite()
           if p.op == "dot_product_attention" and p.name == "B1 T256 N4 H64"]
  monkeypatch.setattr(bench_suite, "grid_suite", lambda: quick)
  shape = ["B1 T256 N4 H64"]
  bench_suite.autotune_suite(None, shape, str(tmp_path), 1, None, grid=True)
  (folder,) = tmp_path.iterdir()
  path = folder / "dot_product_attention_grid.json"

  def entries():
    measurements = json.loads(path.read_text())["measurements"]
    out = {(m["key"], m["direction"], m["implementation"]): m["time_ms"]
           for m in measurements}
    assert len(out) == len(measurements)  # one entry per call and implementation
    return out
  first = entries()
  assert {impl for _, _, impl in first} == {"xla", "xla_chunked"}
  # The version of a package this run does not measure stays recorded (here one
  # an earlier run named), this run's versions replace the earlier ones.
  data = json.loads(path.read_text())
  data["versions"].update({"tokamax-elsewhere": "7.1", "jax": "0.0.1"})
  path.write_text(json.dumps(data))
  bench_suite.autotune_suite(None, shape, str(tmp_path), 1, None, grid=True,
                             skip=("xla_chunked",))
  versions = json.loads(path.read_text())["versions"]
  assert versions["tokamax-elsewhere"] == "7.1"
  assert versions["jax"] == jax.__version__
  second = entries()
  assert second.keys() == first.keys()
  # xla_chunked's entries are the first run's; xla's were measured again.
  chunked = [k for k in first if k[2] == "xla_chunked"]
  assert chunked and all(second[k] == first[k] for k in chunked)
  # Without the skip, a call measured again replaces what every implementation
  # had there (an implementation that now fails on it must not keep its time).
  measured_once = {k: v for k, v in second.items() if k[2] == "xla"}
  autotune = bench_suite.autotuning.autotune
  monkeypatch.setattr(bench_suite.autotuning, "autotune", _only(autotune, "xla"))
  bench_suite.autotune_suite(None, shape, str(tmp_path), 1, None, grid=True)
  third = entries()
  assert {impl for _, _, impl in third} == {"xla"}
  assert third.keys() == measured_once.keys()
  # The one implementation measured again now fails on the call: its earlier
  # time goes too, the skipped one's stays.
  monkeypatch.setattr(bench_suite.autotuning, "autotune", autotune)
  bench_suite.autotune_suite(None, shape, str(tmp_path), 1, None, grid=True)
  assert {impl for _, _, impl in entries()} == {"xla", "xla_chunked"}
  monkeypatch.setattr(bench_suite.autotuning, "autotune", _failing(autotune, "xla"))
  bench_suite.autotune_suite(None, shape, str(tmp_path), 1, None, grid=True,
                             skip=("xla_chunked",))
  data = json.loads(path.read_text())
  assert {m["implementation"] for m in data["measurements"]} == {"xla_chunked"}
  assert {f["implementation"] for f in data["failures"]} == {"xla"}


def _only(autotune, implementation):
  """`autotune` whose results hold `implementation`'s measurements only."""
  def measured(*args, **kwargs):
    result = autotune(*args, **kwargs)
    return bench_suite.autotuning.AutotuningResult(
        [m for m in result.measurements if m.implementation == implementation],
        device_kind=result.device_kind, versions=result.versions,
        failures=result.failures)
  return measured


def _failing(autotune, implementation):
  """`autotune` whose results say `implementation` failed on every call."""
  def measured(*args, **kwargs):
    result = autotune(*args, **kwargs)
    gone = [m for m in result.measurements if m.implementation == implementation]
    return bench_suite.autotuning.AutotuningResult(
        [m for m in result.measurements if m.implementation != implementation],
        device_kind=result.device_kind, versions=result.versions,
        failures=[*result.failures, *(
            dict(op=m.op, direction=m.direction, key=m.key, implementation=m.implementation,
                 config=None, error="RuntimeError: now fails") for m in gone)])
  return measured


def _shipped_files():
  found = []
  for package in ("tokamax_gpu_mosaic.tuned", "tokamax_gpu_triton.tuned"):
    try:
      root = importlib.resources.files(package)
    except ModuleNotFoundError:
      continue
    for folder in root.iterdir():
      if folder.is_dir():
        found += [(folder.name, f) for f in folder.iterdir() if f.name.endswith(".json")]
  return found


def test_shipped_tuned_data_loads_and_every_key_has_a_kind():
  """Every tuned-data file the GPU backends ship: it loads, it was measured on the
  device kind its folder names, and the nearest-point rule can read its keys."""
  files = _shipped_files()
  if not files:
    pytest.skip("no GPU backend package is installed")
  for slug, path in files:
    result = results.AutotuningResult.loads(path.read_text())
    assert shipped.device_slug(result.device_kind) == slug, path
    assert result.versions.get("jax"), path
    for m in result.measurements:
      kind, numbers = nearest.parse(m.key)
      assert kind and numbers, (path, m.key)
      assert m.time_ms > 0 and m.direction in ("forward", "backward"), (path, m)


def test_shipped_data_keeps_only_this_repository_s_implementations():
  """A plugin installed beside tokamax (the integration tests' example, where
  installed: distribution tokamax-example-plugin) is measured by autotune but not
  written into the data the backends ship."""
  measured = [results.Measurement("layer_norm", "forward", "x=float32[8,16]", impl,
                                  None, 1.0) for impl in ("xla", "example_rms")]
  kept = bench_suite._first_party_only(results.AutotuningResult(
      measured, device_kind="cpu", versions={"jax": jax.__version__,
                                             "tokamax-example-plugin": "0.3.0"}))
  assert [m.implementation for m in kept.measurements] == ["xla"]
  assert "tokamax-example-plugin" not in kept.versions
  # A plugin's author keeps theirs (`autotune --keep <distribution>`).
  if not any(b.distribution == "tokamax-example-plugin" for b in tokamax.backends()):
    pytest.skip("the example plugin is pip-installed by `nox -s tests`")
  kept = bench_suite._first_party_only(
      results.AutotuningResult(measured, device_kind="cpu", versions={
          "jax": jax.__version__, "tokamax-example-plugin": "0.3.0"}),
      also=("tokamax_example_plugin",))
  assert [m.implementation for m in kept.measurements] == ["xla", "example_rms"]
  assert kept.versions["tokamax-example-plugin"] == "0.3.0"


def test_autotune_keep_names_an_installed_distribution():
  bench_suite.check_distributions(("tokamax-xla-reference",))
  with pytest.raises(ValueError, match="my-backend: no installed backend comes from "
                                       "it; installed: .*tokamax-xla-reference"):
    bench_suite.check_distributions(("my-backend",))


def _shipped_attention_grid(device: str) -> results.AutotuningResult:
  """gpu-mosaic's shipped attention grid of `device` (a device slug), as data
  that answers on any device; skips where gpu-mosaic is not installed."""
  try:
    folder = importlib.resources.files("tokamax_gpu_mosaic.tuned")
  except ModuleNotFoundError:
    pytest.skip("tokamax-gpu-mosaic is not installed")
  text = (folder / device / "dot_product_attention_grid.json").read_text()
  data = results.AutotuningResult.loads(text)
  return results.AutotuningResult(data.measurements, device_kind=None)


@pytest.mark.parametrize("b,t,n,k,h,window", [
    (2, 8192, 16, 16, 64, 1024), (4, 4096, 16, 16, 64, 2048),
    (2, 8192, 32, 8, 128, 1024), (2, 8192, 16, 16, 128, 1024)])
def test_h100_data_ranks_mosaic_gpu_first_at_sliding_windows(b, t, n, k, h, window):
  """The H100's shipped grid at causal sliding-window calls off its points, where
  Mosaic GPU ran 1.04-1.11x faster than cuDNN forward and forward+backward
  (H100, `tools/none_check.py`, notes/MEASUREMENTS.md session 82, items 3 and
  7): before the grid had window points of each kind (MHA H64 and H128 beside
  GQA H128), `None` took the registry's order there, cuDNN's."""
  data = _shipped_attention_grid("nvidia_h100_80gb_hbm3")
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, k, h), jnp.bfloat16)
  call = tokamax.AttentionArgs(q, kv, kv, scale=h**-0.5, is_causal=True,
                               local_window=(window, 0))
  forward = data.measured_times("dot_product_attention", "forward", call)
  step = data.step_times("dot_product_attention", call)
  assert forward and min(forward, key=forward.get) == "mosaic_gpu", forward
  assert step and min(step, key=step.get) == "mosaic_gpu", step


@pytest.mark.parametrize("b,t,h,window", [
    (2, 8192, 64, 1024), (2, 8192, 128, 1024), (4, 4096, 128, 2048)])
def test_h200_data_answers_mha_windows_from_its_gqa_windows(b, t, h, window):
  """The H200's shipped grid has causal sliding windows under GQA alone (N32
  K8 H128); an MHA window call takes their ranking (`nearest.KIND_FALLBACK`),
  Mosaic GPU's forward first (0.90-0.94x cuDNN's time at those points), where
  it took the registry's order, cuDNN first. On the H100, whose grid has MHA
  window points, Mosaic GPU's forward ran 1.06-1.11x cuDNN's speed at such
  calls (notes/MEASUREMENTS.md, sessions 82 and 86)."""
  data = _shipped_attention_grid("nvidia_h200")
  q = jax.ShapeDtypeStruct((b, t, 16, h), jnp.bfloat16)
  call = tokamax.AttentionArgs(q, q, q, scale=h**-0.5, is_causal=True,
                               local_window=(window, 0))
  forward = data.measured_times("dot_product_attention", "forward", call)
  assert forward and min(forward, key=forward.get) == "mosaic_gpu", forward
