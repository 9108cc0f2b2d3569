"""custom_vjp of the kernel paths: kernel (or per-platform) forward and backward.

The backward is the FlashAttention backward from the saved out and lse (the cotangent
of a returned lse included): the backward kernel where one was built for (dtype,
head dims, banded, softcap, segments), with atomic or deterministic dq accumulation as the spec says, and
`reference_backward` (the same formulas in pure JAX: exact, but it materializes the
(Sq, Sk) scores) where a build has no backward kernel. The "platform" path picks per
platform at lowering, in both directions: the kernels on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import functools

import jax

from jax_fa4 import (_ffi_calls, _kernel_select, _pack_gqa, _ring, _segment_plan, _sharding,
                     _varying)
from jax_fa4._reference import (reference_attention, reference_attention_visible,
                                reference_backward)
from jax_fa4._spec import AttentionSpec


def reference(spec: AttentionSpec, q, k, v, *segments):
    """The pure-JAX forward the kernel paths stand for: with segments, on their
    visibility; shared with `_kv_float8`'s per-platform reference."""
    if segments:
        return reference_attention_visible(q, k, v, _segment_plan.visibility(*segments),
                                           softmax_scale=spec.softmax_scale,
                                           softcap=spec.softcap)
    return reference_attention(q, k, v, **spec.reference_options())


def _reference_backward(spec: AttentionSpec, q, k, v, out, dout, lse, dlse, *segments):
    visible = _segment_plan.visibility(*segments) if segments else None
    return reference_backward(q, k, v, out, lse, dout, dlse, causal=spec.causal,
                              softmax_scale=spec.softmax_scale, alignment=spec.alignment,
                              window=spec.window, softcap=spec.softcap, visible=visible)


def _on_platform(spec: AttentionSpec, kernel, reference, *args):
    if spec.path == "cute":
        return kernel(*args)
    # path "platform" (the "reference" path never reaches custom_vjp: plain autodiff
    # serves it). Both branches are traced; lowering keeps the target platform's, so
    # one jitted function runs the kernel on CUDA and the reference elsewhere.
    return jax.lax.platform_dependent(*args, cuda=kernel, default=reference)


def _forward_on_shard(spec: AttentionSpec, q, k, v, *segments):
    kernel = _pack_gqa.fwd if spec.pack_gqa else _ffi_calls.fwd
    return _on_platform(spec, functools.partial(kernel, spec=spec),
                        functools.partial(reference, spec), q, k, v, *segments)


def _backward_on_shard(spec: AttentionSpec, q, k, v, out, dout, lse, dlse, *segments):
    kernel = _pack_gqa.bwd if spec.pack_gqa else _ffi_calls.bwd
    return _on_platform(spec, functools.partial(kernel, spec=spec),
                        functools.partial(_reference_backward, spec),
                        q, k, v, out, dout, lse, dlse, *segments)


_sharded_forward = _sharding.sharded(_forward_on_shard, _sharding.FORWARD, _ring.ring_forward)
_sharded_backward = _sharding.sharded(_backward_on_shard, _sharding.BACKWARD,
                                      _ring.ring_backward)
_sharded_forward_segments = _sharding.sharded(_forward_on_shard, _sharding.FORWARD_SEGMENTS,
                                              _ring.segment_ring_forward)
_sharded_backward_segments = _sharding.sharded(_backward_on_shard,
                                               _sharding.BACKWARD_SEGMENTS,
                                               _ring.segment_ring_backward)


def _forward(spec: AttentionSpec, q, k, v, segments):
    if segments:
        return _sharded_forward_segments(spec)(q, k, v, *segments)
    return _sharded_forward(spec)(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(spec: AttentionSpec, q, k, v, segments=()):
    """q (B, Sq, H, D), k/v (B, Sk, H, D) -> out (B, Sq, H, D), lse (B, H, Sq) fp32.
    segments: () or the segment kernels' (rows, keys) (`_segment_plan`), integer arrays
    with no cotangent."""
    return _forward(spec, q, k, v, segments)


def _fwd(spec, q, k, v, segments):
    out, lse = _forward(spec, q, k, v, segments)
    return (out, lse), (q, k, v, out, lse, segments)


def _bwd(spec, residuals, cotangents):
    q, k, v, out, lse, segments = residuals
    # custom_vjp instantiates symbolic-zero cotangents, so dlse is a (B, H, Sq) fp32
    # array of zeros when lse is not an output (or not used), as the kernel needs.
    dout, dlse = cotangents
    if _kernel_select.bwd_kernel(spec) is None:
        if spec.path == "cute":  # forced kernels: none differentiates this call
            raise NotImplementedError(
                "jax_fa4.attention(implementation='cute'): no backward kernel was built "
                f"for this call's forward kernel {_kernel_select.fwd_kernel(spec)['name']} "
                "(a module built with fewer kernels); implementation=None differentiates "
                "it with the reference")
        # XLA partitions the pure-JAX backward itself (per batch and head, no collectives).
        grads = _reference_backward(spec, q, k, v, out, dout, lse, dlse, *segments)
    elif segments:
        grads = _sharded_backward_segments(spec)(q, k, v, out, dout, lse, dlse, *segments)
    else:
        grads = _sharded_backward(spec)(q, k, v, out, dout, lse, dlse)
    return (*_varying.sum_like((q, k, v), grads), None)


attention.defvjp(_fwd, _bwd)
