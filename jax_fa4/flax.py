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
              softmax_scale=None, implementation=None):
    """query (batch..., Sq, Hq, D), key (batch..., Sk, Hkv, D), value (batch..., Sk, Hkv, Dv)
    -> (batch..., Sq, Hq, Dv). `causal` (or nnx's `is_causal`) is top-left aligned.
    `dtype` casts the inputs; `precision` and `broadcast_dropout` have no effect (the
    kernel's precision is fixed, and dropout is refused)."""
    del broadcast_dropout, dropout_rng, precision
    if bias is not None:
        _adapters.refuse("an additive attention bias",
                         "use flax.linen/nnx dot_product_attention for biased attention")
    if dropout_rate > 0.0 and not deterministic:
        _adapters.refuse("attention dropout",
                         "set dropout_rate=0.0, or deterministic=True at inference")
    if module is not None:
        _adapters.refuse("sown attention weights (sow_weights=True)",
                         "jax_fa4 never materializes them; use Flax's default attention")
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    sq, sk = query.shape[-3], key.shape[-3]
    causal = causal or is_causal or _adapters.mask_kind(mask, sq, sk) == "causal"
    lead = query.shape[:-3]
    b = math.prod(lead)
    q, k, v = (x.reshape(b, *x.shape[-3:]) for x in (query, key, value))
    out = _attention(q, k, v, causal=causal, alignment="top_left",
                     softmax_scale=softmax_scale, implementation=implementation)
    return jnp.reshape(out, (*lead, *out.shape[1:]))
