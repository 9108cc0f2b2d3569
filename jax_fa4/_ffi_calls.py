"""The only place that builds XLA FFI calls to the native handlers (jax_fa4._ffi).

vmap reaches these calls already folded into the batch (_sharding.py); the handlers
also fold any leading dimensions into the batch, so `broadcast_all` is exact should a
call be batched directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fa4._sharding import vary_like
from jax_fa4._spec import AttentionSpec

FWD_TARGET = "jax_fa4_fwd"


def fwd(q, k, v, spec: AttentionSpec):
    """q (..., Sq, H, D), k/v (..., Sk, H, D) -> out (..., Sq, H, D), lse (..., H, Sq) fp32."""
    *lead, sq, heads, _ = q.shape
    results = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((*lead, heads, sq), jnp.float32),
    )
    call = jax.ffi.ffi_call(FWD_TARGET, results, vmap_method="broadcast_all")
    return vary_like(q, call(q, k, v, **spec.ffi_attributes()))
