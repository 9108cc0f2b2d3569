"""Ring attention's building blocks, shared by `ring_attention` (inside `shard_map`) and
the automatic path of a sequence-sharded `jit` (`ring_forward` / `ring_backward`, which
the partitioner runs per device).

The sequence is split into n contiguous chunks along a mesh axis, one per device.
K/V chunks travel around the ring, one hop per step; each device attends its queries
to the chunk it holds and merges the partial results through their LSE. The backward
runs the FlashAttention backward of each chunk pair from the global out and lse, and
the dK/dV accumulators travel with their chunk, taking one last hop home.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax


def chunk_pair(band, length, chunks, q_chunk, kv_chunk, run, nothing, *args):
    """One query chunk against one key/value chunk, of `length` positions each, out of
    `chunks` chunks of the sequence: run(lo, hi, *args) where key j of the chunk is
    visible from query i of the chunk iff lo <= j - i <= hi (None: unbounded side), or
    nothing(*args) when no pair is visible.

    band: (left, right) of the global self-attention band, key position - query
    position in [-left, right] (None: unbounded; causal is right = 0). Chunk ids may be
    traced: one lax.switch branch per distinct local band, each static."""
    left, right = band
    cases, index = {}, []
    for d in range(1 - chunks, chunks):  # kv_chunk - q_chunk
        lo = None if left is None or -left - d * length <= 1 - length else -left - d * length
        hi = None if right is None or right - d * length >= length - 1 else right - d * length
        hidden = (lo is not None and lo >= length) or (hi is not None and hi <= -length)
        index.append(cases.setdefault(None if hidden else (lo, hi), len(cases)))
    branches = [functools.partial(run, *case) if case else nothing for case in cases]
    if len(branches) == 1:
        return branches[0](*args)
    which = jnp.asarray(index, jnp.int32)[kv_chunk - q_chunk + chunks - 1]
    return lax.switch(which, branches, *args)


def unseen(q, v):
    """(out, lse) of queries that saw no key: zeros (fp32) and -inf."""
    b, s, h, _ = q.shape
    return (jnp.zeros((b, s, h, v.shape[-1]), jnp.float32),
            jnp.full((b, h, s), -jnp.inf, jnp.float32))


def merge(a, b):
    """Combine two softmax-normalized partial results through their LSE. A side that
    saw no key (lse = -inf) gets weight 0, also when both did (no NaN)."""
    (o_a, l_a), (o_b, l_b) = a, b
    lse = jnp.logaddexp(l_a, l_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a, w_b = jnp.exp(l_a - safe), jnp.exp(l_b - safe)

    def rows(w):  # (B, H, S) -> (B, S, H, 1), the layout of out
        return jnp.swapaxes(w, 1, 2)[..., None]

    return o_a * rows(w_a) + o_b * rows(w_b), lse


def ring_forward(attend, spec, axis_name, q, k, v):
    """The automatic path's forward on one device of a sequence-sharded `jit`: q, k, v
    hold this device's contiguous chunks of the `axis_name`-sharded sequence;
    attend(spec, q, k, v) -> (out, lse) runs one chunk pair (the kernel call). Returns
    this device's (out, lse), merged over the ring."""
    def run(_, hi, q, k, v):  # causal or not: (lo, hi) is (None, 0) or (None, None)
        out, lse = attend(dataclasses.replace(spec, causal=hi == 0), q, k, v)
        return out.astype(jnp.float32), lse

    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    acc = None
    for step in range(n):
        if step:
            k, v = hop((k, v), axis_name, n)
        part = chunk_pair(_band(spec), q.shape[1], n, me, (me - step) % n, run,
                          lambda q, k, v: unseen(q, v), q, k, v)
        acc = part if acc is None else merge(acc, part)
    out, lse = acc
    return out.astype(q.dtype), lse


def ring_backward(differentiate, spec, axis_name, q, k, v, out, dout, lse, dlse):
    """The automatic path's backward: differentiate(spec, q, k, v, out, dout, lse, dlse)
    -> (dq, dk, dv) runs the FlashAttention backward of one chunk pair from the global
    out and lse (so P and D are the whole sequence's)."""
    def run(_, hi, k, v):
        grads = differentiate(dataclasses.replace(spec, causal=hi == 0), q, k, v, out, dout,
                              lse, dlse)
        return tuple(g.astype(jnp.float32) for g in grads)

    def nothing(k, v):
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    dq, dk, dv = nothing(k, v)
    for step in range(n):
        if step:
            k, v, dk, dv = hop((k, v, dk, dv), axis_name, n)
        parts = chunk_pair(_band(spec), q.shape[1], n, me, (me - step) % n, run, nothing, k, v)
        dq, dk, dv = dq + parts[0], dk + parts[1], dv + parts[2]
    dk, dv = hop((dk, dv), axis_name, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _band(spec):
    """The automatic path's band: causal or none (_sharding refuses windows over a
    sharded sequence)."""
    return (None, 0) if spec.causal else (None, None)


def hop(values, axis_name, n):
    """Device i sends `values` to device i + 1 (mod n)."""
    return lax.ppermute(values, axis_name, [(i, (i + 1) % n) for i in range(n)])

