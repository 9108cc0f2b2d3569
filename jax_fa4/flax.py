"""Drop-in attention for Flax modules: `attention` is a linen and nnx `attention_fn`.

    from jax_fa4 import flax as fa4
    nnx.MultiHeadAttention(..., attention_fn=fa4.attention)      # mha(x, is_causal=True)
    nn.MultiHeadDotProductAttention(..., attention_fn=functools.partial(fa4.attention,
                                                                        causal=True))

It takes the keyword arguments Flax passes, with Flax's conventions: inputs
(batch..., length, heads, head_dim), softmax scale 1/sqrt(head_dim), causal masks
top-left (`jnp.tril`). What jax_fa4 cannot compute is refused with the alternative: an
additive bias, attention dropout, sown attention weights, and masks it cannot read (any
mask built under jit; a concrete mask that is neither all-visible nor causal).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_fa4 import _adapters
from jax_fa4._api import attention as _attention


def attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
              dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
              precision=None, module=None, is_causal=False, *, causal=False,
              softmax_scale=None, implementation=None, force_fp32_for_softmax=False,
              einsum_dot_general=None, qk_attn_weights_einsum=None,
              attn_weights_value_einsum=None):
    """query (batch..., Sq, Hq, D), key (batch..., Sk, Hkv, D), value (batch..., Sk, Hkv, Dv)
    -> (batch..., Sq, Hq, Dv). `causal` (or nnx's `is_causal`) is top-left aligned.
    `dtype` casts the inputs (default: their common dtype, as Flax promotes them);
    `precision`, `broadcast_dropout` and `force_fp32_for_softmax` have no effect (the
    kernel's precision is fixed, its softmax is float32, and dropout is refused). Custom
    einsums are refused: linen passes an attention_fn only the arguments its signature
    names, so without them here a quantized einsum would be dropped unseen."""
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if not (einsum_dot_general is qk_attn_weights_einsum is attn_weights_value_einsum
            is None):
        _adapters.refuse("custom einsums (einsum_dot_general, qk_attn_weights_einsum, "
                         "attn_weights_value_einsum)",
                         "use Flax's dot_product_attention for quantized or custom einsums")
    if bias is not None:
        _adapters.refuse("an additive attention bias",
                         "use flax.linen/nnx dot_product_attention for biased attention")
    if dropout_rate > 0.0 and not deterministic:
        _adapters.refuse("attention dropout",
                         "set dropout_rate=0.0, or deterministic=True at inference")
    if module is not None:
        _adapters.refuse("sown attention weights (sow_weights=True)",
                         "jax_fa4 never materializes them; use Flax's default attention")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError("query, key and value must have the same batch dims; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    # Flax's promote_dtype: the given dtype, else the inputs' common one.
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    lead = query.shape[:-3]
    scores = (*lead, query.shape[-2], query.shape[-3], key.shape[-3])
    causal = causal or is_causal or _adapters.mask_kind(mask, scores) == "causal"
    b = math.prod(lead)
    q, k, v = (x.reshape(b, *x.shape[-3:]) for x in (query, key, value))
    out = _attention(q, k, v, causal=causal, alignment="top_left",
                     softmax_scale=softmax_scale, implementation=implementation)
    return jnp.reshape(out, (*lead, *out.shape[1:]))
