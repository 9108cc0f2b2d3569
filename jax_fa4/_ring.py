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

# Relation of a key chunk to a query chunk under causal masking.
FULL, DIAGONAL, HIDDEN = 0, 1, 2


def chunk_pair(causal, q_chunk, kv_chunk, run, nothing, *args):
    """run(chunk_causal, *args) for a query chunk against a key/value chunk: every key
    (chunk_causal False), causal within the chunk (the diagonal, True), or nothing(*args)
    for a chunk wholly in the future. Chunk ids may be traced (lax.switch)."""
    if not causal:
        return run(False, *args)
    which = jnp.where(kv_chunk < q_chunk, FULL, jnp.where(kv_chunk == q_chunk, DIAGONAL, HIDDEN))
    branches = [functools.partial(run, False), functools.partial(run, True), nothing]
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
    def run(causal, q, k, v):
        out, lse = attend(dataclasses.replace(spec, causal=causal), q, k, v)
        return out.astype(jnp.float32), lse

    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    acc = None
    for step in range(n):
        if step:
            k, v = hop((k, v), axis_name, n)
        part = chunk_pair(spec.causal, me, (me - step) % n, run,
                          lambda q, k, v: unseen(q, v), q, k, v)
        acc = part if acc is None else merge(acc, part)
    out, lse = acc
    return out.astype(q.dtype), lse


def ring_backward(differentiate, spec, axis_name, q, k, v, out, dout, lse, dlse):
    """The automatic path's backward: differentiate(spec, q, k, v, out, dout, lse, dlse)
    -> (dq, dk, dv) runs the FlashAttention backward of one chunk pair from the global
    out and lse (so P and D are the whole sequence's)."""
    def run(causal, k, v):
        grads = differentiate(dataclasses.replace(spec, causal=causal), q, k, v, out, dout,
                              lse, dlse)
        return tuple(g.astype(jnp.float32) for g in grads)

    def nothing(k, v):
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    dq, dk, dv = nothing(k, v)
    for step in range(n):
        if step:
            k, v, dk, dv = hop((k, v, dk, dv), axis_name, n)
        parts = chunk_pair(spec.causal, me, (me - step) % n, run, nothing, k, v)
        dq, dk, dv = dq + parts[0], dk + parts[1], dv + parts[2]
    dk, dv = hop((dk, dv), axis_name, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def hop(values, axis_name, n):
    """Device i sends `values` to device i + 1 (mod n)."""
    return lax.ppermute(values, axis_name, [(i, (i + 1) % n) for i in range(n)])

