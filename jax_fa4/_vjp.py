"""custom_vjp of the kernel paths: kernel (or per-platform) forward, FlashAttention
backward.

The backward is `reference_backward`: the FlashAttention formulas from the saved out and
lse, in pure JAX, so exact (the cotangent of a returned lse included) but slow (it
materializes the (Sq, Sk) scores). The backward kernels implement the same contract and
will replace `_bwd`'s body alone.
"""

from __future__ import annotations

import functools

import jax

from jax_fa4 import _ffi_calls, _sharding
from jax_fa4._reference import reference_attention, reference_backward
from jax_fa4._spec import AttentionSpec


def _reference(spec: AttentionSpec, q, k, v):
    return reference_attention(q, k, v, **spec.reference_options())


def _forward_on_shard(spec: AttentionSpec, q, k, v):
    kernel = functools.partial(_ffi_calls.fwd, spec=spec)
    if spec.path == "cute":
        return kernel(q, k, v)
    # path "platform" (the "reference" path never reaches custom_vjp: plain autodiff
    # serves it). Both branches are traced; lowering keeps the target platform's, so
    # one jitted function runs the kernel on CUDA and the reference elsewhere.
    return jax.lax.platform_dependent(
        q, k, v, cuda=kernel, default=functools.partial(_reference, spec))


_sharded_forward = _sharding.sharded(_forward_on_shard)


def _forward(spec: AttentionSpec, q, k, v):
    return _sharded_forward(spec)(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(spec: AttentionSpec, q, k, v):
    """q (B, Sq, H, D), k/v (B, Sk, H, D) -> out (B, Sq, H, D), lse (B, H, Sq) fp32."""
    return _forward(spec, q, k, v)


def _fwd(spec, q, k, v):
    out, lse = _forward(spec, q, k, v)
    return (out, lse), (q, k, v, out, lse)


def _bwd(spec, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return reference_backward(q, k, v, out, lse, dout, dlse, causal=spec.causal,
                              softmax_scale=spec.softmax_scale)


attention.defvjp(_fwd, _bwd)
