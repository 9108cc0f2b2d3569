"""Context parallelism: attention over sequences split across devices (ring attention).

Inside `shard_map`, each device holds one chunk of the queries and one chunk of the keys
and values of every sequence. K/V chunks travel around the ring with `ppermute`, one
hop per step; at each step a device attends its queries to the chunk it holds, with the
kernel (or the reference off Hopper), and merges the partial results through their LSE.
XLA can overlap each hop with the step's attention. Gradients come from autodiff through
the ring (the transpose of a hop is the reverse hop), so only `ppermute`s cross devices.

Causal attention over contiguous chunks leaves device 0 little work and the last device
the most. The zigzag layout balances it: with n devices the sequence is cut into 2n
chunks and device r holds chunks r and 2n-1-r (`zigzag` / `unzigzag` reorder a global
sequence into and out of that layout).
"""

from __future__ import annotations


import jax.numpy as jnp
from jax import lax

from jax_fa4._api import attention
from jax_fa4._ring import chunk_pair, hop, merge, unseen
from jax_fa4._sharding import vary_like

LAYOUTS = ("contiguous", "zigzag")


def ring_attention(q, k, v, *, axis_name, causal=False, softmax_scale=None,
                   layout="contiguous", return_lse=False, implementation=None):
    """Attention of sequences sharded along `axis_name`; call inside `shard_map`.

    q (B, Sq_local, H, D), k/v (B, Sk_local, Hkv, D): this device's chunks, as laid out by
    `layout` ("contiguous": device r holds the r-th chunk; "zigzag": chunks r and
    2n-1-r, see `zigzag`). Returns this device's out (B, Sq_local, H, D), plus lse
    (B, H, Sq_local) fp32 when `return_lse`. Causal needs Sq_local == Sk_local (the same
    positions for queries and keys, as in self-attention); it is aligned to the global
    sequence. Other arguments are those of `jax_fa4.attention`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError("causal ring attention needs query and key chunks of the same "
                         f"length; got q {q.shape} and k {k.shape}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout needs an even local length; got {q.shape[1]}")
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)

    def run(chunk_causal, q, k, v):
        out, lse = attention(q, k, v, causal=chunk_causal, softmax_scale=softmax_scale,
                             return_lse=True, implementation=implementation)
        return out.astype(jnp.float32), lse

    def hidden(q, k, v):
        return vary_like((q, k, v), unseen(q, v))

    halves = 2 if layout == "zigzag" else 1
    q_parts = jnp.split(q, halves, axis=1)
    q_chunks = _chunk_ids(me, n, layout)
    acc = [None] * halves
    for step in range(n):
        if step:  # one hop: device i sends its K/V to device i + 1
            k, v = hop((k, v), axis_name, n)
        kv_chunks = _chunk_ids((me - step) % n, n, layout)
        for k_part, v_part, c in zip(jnp.split(k, halves, axis=1),
                                     jnp.split(v, halves, axis=1), kv_chunks):
            for i, (q_part, a) in enumerate(zip(q_parts, q_chunks)):
                part = chunk_pair(causal, a, c, run, hidden, q_part, k_part, v_part)
                acc[i] = part if acc[i] is None else merge(acc[i], part)
    out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
    lse = jnp.concatenate([l for _, l in acc], axis=2)
    return (out, lse) if return_lse else out


def zigzag(x, n: int, axis: int = 1):
    """Reorder a global sequence axis so that n contiguous shards are the zigzag layout:
    shard r holds chunks r and 2n-1-r of the original 2n chunks."""
    chunks = jnp.split(x, 2 * n, axis=axis)
    return jnp.concatenate([c for r in range(n) for c in (chunks[r], chunks[2 * n - 1 - r])],
                           axis=axis)


def unzigzag(x, n: int, axis: int = 1):
    """Inverse of `zigzag`."""
    chunks = jnp.split(x, 2 * n, axis=axis)
    order = [None] * (2 * n)
    for r in range(n):
        order[r], order[2 * n - 1 - r] = chunks[2 * r], chunks[2 * r + 1]
    return jnp.concatenate(order, axis=axis)


def _chunk_ids(device, n, layout):
    return (device,) if layout == "contiguous" else (device, 2 * n - 1 - device)

