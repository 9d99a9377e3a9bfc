"""Flax adapters: tokamax attention as Flax's ``attention_fn``, and Flax modules
computed by tokamax's ops.

One line moves a Flax model's attention onto tokamax::

    attn = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                  attention_fn=tokamax.flax.attention_fn, rngs=rngs)
    attn = nn.MultiHeadDotProductAttention(num_heads=8,
                                           attention_fn=tokamax.flax.attention_fn)

`attention_fn` takes the keywords Flax calls it with and maps Flax's conventions
(layouts ``[*batch, T, N, H]``, mask and bias broadcastable to ``[*batch, N, T, S]``,
True in the mask attends, the ``1/sqrt(H)`` scale, ``dtype`` and ``precision``) onto
`tokamax.dot_product_attention`. `attention_fn_for` picks the implementation.
Differences from Flax's own `dot_product_attention`, each an error rather than a
silently different result, except the last:

- attention dropout (``dropout_rate > 0`` outside ``deterministic``) is refused: the
  fused kernels have none;
- ``sow_weights`` is refused: the kernels never materialize the attention weights;
- a query row that sees no key at all outputs 0 (Flax's gives the mean of the
  values, its softmax over equal large negative logits).

Modules. `RMSNorm` / `LayerNorm` are `flax.nnx.RMSNorm` / `flax.nnx.LayerNorm`
computed by `tokamax.rms_norm` / `tokamax.layer_norm`, and `tokamax.flax.linen`'s
are `flax.linen`'s: the same arguments, parameter names and initializers, so a
checkpoint of the Flax module loads unchanged. Two modules Flax does not have,
their parameters in the layouts the ops take:

- `GatedMLP` (`SwiGLU`, `GeGLU`): ``down(activation(x @ w_gate) * (x @ w_up))`` by
  `tokamax.gated_linear_unit`, gate and up kernels as one ``[K, 2, N]`` parameter
  (`GatedMLP.load_linears` loads a Flax MLP's three `nnx.Linear` layers);
- `MoE`: router, top-k, optional capacity, experts by a grouped
  `tokamax.gated_linear_unit` and `tokamax.ragged_dot`, and
  expert parallelism by `tokamax.moe_all_to_all` inside `jax.shard_map`.

Every module takes ``implementation=`` (None by default) as its op does.
Importing this module imports Flax (`pip install "tokamax-core[flax]"`); `import
tokamax` does not.
"""

from tokamax.flax import linen
from tokamax.flax._attention import attention_fn
from tokamax.flax._attention import attention_fn_for
from tokamax.flax._mlp import GatedMLP
from tokamax.flax._mlp import GeGLU
from tokamax.flax._mlp import SwiGLU
from tokamax.flax._moe import MoE
from tokamax.flax._norms import LayerNorm
from tokamax.flax._norms import RMSNorm

__all__ = [
    "GatedMLP",
    "GeGLU",
    "LayerNorm",
    "MoE",
    "RMSNorm",
    "SwiGLU",
    "attention_fn",
    "attention_fn_for",
    "linen",
]
