"""float8_e4m3fn attention inputs: dequantized by their descales, forward only.

No kernel takes float8 yet, so such a call runs the reference on q * q_descale,
k * k_descale, v * v_descale in float32 and casts out to the spec's out_dtype. A
descale is one float32 per tensor (shape ()) or per K/V head (Hkv,); the query heads
of a group share their K/V head's q descale. Forward only: a gradient through q, k, v
or a descale raises when it is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _forward_only(x):
    return x


def _forward_only_fwd(x):
    return x, None


def _forward_only_bwd(_, cotangent):
    raise NotImplementedError(
        "jax_fa4.attention with float8_e4m3fn q, k, v is forward only: it has no "
        "gradient with respect to q, k, v or their descales (train in bfloat16 or "
        "float16)")


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def dequantize(q, k, v, *, q_descale, k_descale, v_descale):
    """float32 q * q_descale, k * k_descale, v * v_descale, refusing gradients."""
    heads_q, heads_kv = q.shape[-2], k.shape[-2]

    def scaled(x, descale, repeat):
        x = _forward_only(x).astype(jnp.float32)
        if descale is None:
            return x
        descale = _forward_only(descale)
        if descale.ndim:  # per K/V head: each query head takes its group's
            descale = jnp.repeat(descale, repeat)[:, None]
        return x * descale

    return (scaled(q, q_descale, heads_q // max(heads_kv, 1)), scaled(k, k_descale, 1),
            scaled(v, v_descale, 1))
