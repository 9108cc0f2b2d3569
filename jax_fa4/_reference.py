"""Pure-JAX attention: the CPU / non-Hopper path, the backward for now, the test oracle.

Same conventions as the kernels: causal is bottom-right aligned (query i sees key j iff
j <= i + Sk - Sq), LSE is the natural log, and a query row that sees no key gives
out = 0 and lse = -inf without NaN in the value or in any gradient.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def reference_attention(q, k, v, *, causal: bool, softmax_scale: float,
                        compute_dtype=jnp.float32):
    """q (..., Sq, H, D), k/v (..., Sk, H, D) -> out (..., Sq, H, D) in q.dtype,
    lse (..., H, Sq) float32.

    `compute_dtype` is the dtype of the two matmuls and of their results: float32 for the
    reference, the input dtype for the "same math in low precision" baseline of the
    numerics rule (KERNELS.md). As in FlashAttention's own reference, the softmax itself
    always runs in float32 and P is rounded to `compute_dtype` before P @ V. HIGHEST
    precision keeps float32 matmuls out of TF32 on GPUs.
    """
    cd = jnp.dtype(compute_dtype)
    sq, sk = q.shape[-3], k.shape[-3]
    s = jnp.einsum("...qhd,...khd->...hqk", q.astype(cd), k.astype(cd),
                   precision=lax.Precision.HIGHEST)
    s = s.astype(jnp.float32) * jnp.float32(softmax_scale)
    if causal:
        row = lax.broadcasted_iota(jnp.int32, (sq, sk), 0)
        col = lax.broadcasted_iota(jnp.int32, (sq, sk), 1)
        s = jnp.where(col <= row + (sk - sq), s, -jnp.inf)
    # Safe max: a row with no visible key has max -inf; shifting by 0 there keeps
    # exp(-inf - 0) = 0 instead of exp(-inf - -inf) = NaN. The shift cancels in the
    # result, so it carries no gradient.
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m)))
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    seen = l > 0
    # Dividing by 1 where nothing was seen keeps out = 0 and the gradient finite.
    l_safe = jnp.where(seen, l, jnp.ones_like(l))
    out = jnp.einsum("...hqk,...khd->...qhd", (p / l_safe).astype(cd), v.astype(cd),
                     precision=lax.Precision.HIGHEST)
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return out.astype(q.dtype), lse
