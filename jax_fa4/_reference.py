"""Pure-JAX attention: the CPU / non-Hopper path, the backward where a build has no
backward kernel, the test oracle.

Same conventions as the kernels (the contract is `jax_fa4.attention`'s docstring; which
keys a query sees is `_masks`): causal and windows are bottom-right aligned unless
alignment="top_left", LSE is the natural log, and a query row that sees no key gives
out = 0 and lse = -inf (lse = sink with sinks) without NaN in the value or in any
gradient. Memory is O(Sq * Sk) per (batch, head): the scores are materialized.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_fa4 import _masks


def reference_attention(q, k, v, *, causal: bool, softmax_scale: float,
                        compute_dtype=jnp.float32, alignment: str = "bottom_right",
                        window=None, softcap: float | None = None, sinks=None,
                        q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                        kv_lengths=None):
    """q (..., Sq, Hq, D), k (..., Sk, Hkv, D), v (..., Sk, Hkv, Dv) -> out (..., Sq, Hq, Dv)
    in q.dtype, lse (..., Hq, Sq) float32.

    Features as in `jax_fa4.attention` (window: (left, right), right None when causal;
    segment ids (..., Sq) / (..., Sk), lengths (...,), sinks (Hq,)); no validation here.

    `compute_dtype` is the dtype of the two matmuls and of their results: float32 for the
    reference, the input dtype for the "same math in low precision" baseline of the
    numerics rule (tests/README.md). As in FlashAttention's own reference, the softmax (and
    softcap) always runs in float32 and P is rounded to `compute_dtype` before P @ V.
    HIGHEST precision keeps float32 matmuls out of TF32 on GPUs.
    """
    visibility = _masks.padded(
        q.shape[-3], k.shape[-3], causal=causal, alignment=alignment, window=window,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
        kv_lengths=kv_lengths)
    return _attend(q, k, v, visibility, softmax_scale=softmax_scale, softcap=softcap,
                   sinks=sinks, compute_dtype=compute_dtype)


def reference_attention_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, causal: bool,
                               softmax_scale: float, compute_dtype=jnp.float32,
                               alignment: str = "bottom_right", window=None,
                               softcap: float | None = None, sinks=None):
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens
    (num_seqs + 1,) -> out (total_q, Hq, Dv), lse (Hq, total_q) float32.

    One (total_q, total_k) score matrix per head, masked to the sequences' blocks.
    """
    visibility = _masks.varlen(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                               causal=causal, alignment=alignment, window=window)
    return _attend(q, k, v, visibility, softmax_scale=softmax_scale, softcap=softcap,
                   sinks=sinks, compute_dtype=compute_dtype)


def reference_attention_visible(q, k, v, visible, *, softmax_scale: float,
                                softcap: float | None = None, compute_dtype=jnp.float32):
    """q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), visible bool (B, Sq, Sk)
    -> out, lse as `reference_attention`: the visibility given outright (the segment
    kernels' rows and keys, `_segment_plan.visibility`)."""
    return _attend(q, k, v, _masks.Visibility(visible, None), softmax_scale=softmax_scale,
                   softcap=softcap, sinks=None, compute_dtype=compute_dtype)


def _attend(q, k, v, visibility: _masks.Visibility, *, softmax_scale, softcap, sinks,
            compute_dtype):
    cd = jnp.dtype(compute_dtype)
    *lead, sq, heads_q, head_dim = q.shape
    heads_kv, head_dim_v = k.shape[-2], v.shape[-1]
    group = heads_q // heads_kv if heads_kv else 1
    # Query head h reads KV head h // group: split Hq into (Hkv, group), never repeat K/V.
    q = q.reshape(*lead, sq, heads_kv, group, head_dim)
    s = jnp.einsum("...qhgd,...khd->...hgqk", q.astype(cd), k.astype(cd),
                   precision=lax.Precision.HIGHEST)
    s = s.astype(jnp.float32) * jnp.float32(softmax_scale)
    if softcap is not None:
        s = jnp.float32(softcap) * jnp.tanh(s / jnp.float32(softcap))
    if visibility.mask is not None:
        s = jnp.where(visibility.mask[..., None, None, :, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    if sinks is not None:
        # The sink is one more logit per row, without a value: it joins the max and the
        # denominator only.
        sink = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(heads_kv, group, 1, 1), m.shape)
        m = jnp.maximum(m, sink)
    # Safe max: a row with no visible key (and no sink) has max -inf; shifting by 0 there
    # keeps exp(-inf - 0) = 0 instead of exp(-inf - -inf) = NaN. The shift cancels in the
    # result, so it carries no gradient.
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m)))
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    # Nothing seen: l is exactly 0. A NaN l (a NaN score or sink) counts as seen, so that
    # out and lse are NaN too, as on the kernel path, rather than 0 and -inf.
    seen = l != 0
    # Dividing by 1 where nothing was seen keeps out = 0 and the gradient finite.
    l_safe = jnp.where(seen, l, jnp.ones_like(l))
    out = jnp.einsum("...hgqk,...khd->...qhgd", (p / l_safe).astype(cd), v.astype(cd),
                     precision=lax.Precision.HIGHEST)
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    out = out.reshape(*lead, sq, heads_q, head_dim_v)
    lse = lse.reshape(*lead, heads_q, sq)
    if visibility.q_valid is not None:
        # Rows that are not queries (padding) see no key; with sinks they must still give
        # out = 0 and lse = -inf rather than the sink.
        out = jnp.where(visibility.q_valid[..., :, None, None], out, jnp.zeros_like(out))
        lse = jnp.where(visibility.q_valid[..., None, :], lse, -jnp.inf)
    return out.astype(q.dtype), lse


def reference_backward(q, k, v, out, lse, dout, dlse, *, causal: bool, softmax_scale: float,
                       compute_dtype=jnp.float32, alignment: str = "bottom_right",
                       window=None, softcap: float | None = None, visible=None):
    """The FlashAttention backward from the forward's out and lse: the contract of the
    backward kernels, the backward of configurations without one, and the oracle of their
    tests.

    With S = Q K^T, P = exp(scale * S - lse), dP = dO V^T, D = rowsum(dO * O) - dlse and
    dS = P * (dP - D):  dQ = scale * dS K,  dK = scale * dS^T Q,  dV = P^T dO. With
    softcap c, P = exp(c tanh(scale * S / c) - lse) and dS carries the slope 1 - tanh^2.
    q, out, dout (..., Sq, H, D); k, v (..., Sk, Hkv, D) with Hkv dividing H (GQA/MQA:
    dk, dv sum over each group of query heads); lse, dlse (..., H, Sq). Causal and window
    use `alignment` as in `reference_attention`; `visible` (..., Sq, Sk) bool, when
    given, replaces causal, window and alignment; rows with lse = -inf (no visible key)
    contribute nothing; dq, dk, dv come back in the dtypes of q, k, v.

    `compute_dtype` float32 is the reference. The input dtype gives the numerics rule's
    low-precision baseline for the backward kernels (tests/README.md): the same algorithm with
    every intermediate (S, P, dP, D, dS and the products) rounded to that dtype. Autodiff
    of the low-precision forward is not that baseline: for a row with one visible key its
    softmax gradient is exactly 0, where any D = rowsum(dO * O) formulation is not.
    """
    cd = jnp.dtype(compute_dtype)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    rnd = lambda x: x.astype(cd).astype(jnp.float32)  # noqa: E731
    highest = lax.Precision.HIGHEST

    def mm(spec, a, b):
        return rnd(jnp.einsum(spec, rnd(a), rnd(b), precision=highest))

    scale = jnp.float32(softmax_scale)
    *lead, sq, heads_q, head_dim = q.shape
    heads_kv = k.shape[-2]

    # GQA/MQA: query head h reads key/value head h // group, as the axes (h g). Without
    # groups there is no g axis: a unit axis changes how XLA forms the GEMMs, and so the
    # rounding of this baseline (dk's error on one test draw moved by 20%).
    g = "g" if heads_kv != heads_q else ""

    def grouped(x):  # (..., S, H, D) -> (..., S, Hkv, H / Hkv, D)
        return x.reshape(*x.shape[:-2], heads_kv, -1, x.shape[-1]) if g else x

    def rows(x):  # (..., H, S) -> (..., Hkv, H / Hkv, S)
        return x.reshape(*x.shape[:-2], heads_kv, -1, sq) if g else x

    q_, out_, dout_ = (grouped(f32(x)) for x in (q, out, dout))
    lse, dlse = rows(lse), rows(dlse)
    s = mm(f"...qh{g}d,...khd->...h{g}qk", q_, f32(k)) * scale
    slope = 1.0
    if softcap is not None:
        t = jnp.tanh(s / jnp.float32(softcap))
        s, slope = jnp.float32(softcap) * t, rnd(1.0 - t * t)
    seen = jnp.isfinite(lse)[..., None]
    if visible is None:
        mask = _masks.padded(q.shape[-3], k.shape[-3], causal=causal, alignment=alignment,
                             window=window).mask
    else:  # (..., Sq, Sk) -> (..., heads, [group], Sq, Sk)
        mask = visible[..., None, None, :, :] if g else visible[..., None, :, :]
    visible = seen if mask is None else seen & mask
    p = rnd(jnp.where(visible, jnp.exp(s - jnp.where(seen, lse[..., None], 0.0)), 0.0))
    dp = mm(f"...qh{g}d,...khd->...h{g}qk", dout_, f32(v))
    d = rnd(mm(f"...qh{g}d,...qh{g}d->...h{g}q", dout_, out_) - f32(dlse))
    ds = rnd(p * (dp - d[..., None]) * slope)
    dq = mm(f"...h{g}qk,...khd->...qh{g}d", ds, f32(k)) * scale
    dk = mm(f"...h{g}qk,...qh{g}d->...khd", ds, q_) * scale
    dv = mm(f"...h{g}qk,...qh{g}d->...khd", p, dout_)
    dq = dq.reshape(*lead, sq, heads_q, head_dim)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
