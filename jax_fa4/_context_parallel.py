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
from jax_fa4._ring import (CAUSAL, Cut, causal_zigzag_pairs, chunk_pair, hop, merge,
                            merge_picked, pick, unseen)
from jax_fa4._spec import AttentionSpec
from jax_fa4._validate import band
from jax_fa4._varying import vary_like

LAYOUTS = ("contiguous", "zigzag")


def ring_attention(q, k, v, *, axis_name, causal=False, window=None, q_segment_ids=None,
                   kv_segment_ids=None, softmax_scale=None, layout="contiguous",
                   return_lse=False, implementation=None, deterministic=False):
    """Attention of sequences sharded along `axis_name`; call inside `shard_map`.

    q (B, Sq_local, H, D), k (B, Sk_local, Hkv, D), v (B, Sk_local, Hkv, Dv): this
    device's chunks, as laid out by `layout` ("contiguous": device r holds the r-th
    chunk; "zigzag": chunks r and 2n-1-r, see `zigzag`). Returns this device's out (B, Sq_local, H, Dv), plus lse
    (B, H, Sq_local) fp32 when `return_lse`.

    causal and window=(left, right) act on global positions (self-attention: query and
    key positions coincide, so they need Sq_local == Sk_local): query p sees key p' iff
    p - left <= p' <= p + right (causal: right = 0). Chunk pairs outside the band are
    skipped; a pair the band cuts runs only its visible rows and keys.
    q_segment_ids (B, Sq_local) / kv_segment_ids (B, Sk_local) int32: this device's
    chunks of the ids (laid out like q and k); the key ids travel with their chunk.
    softmax_scale, return_lse, implementation and deterministic are those of
    `jax_fa4.attention`, which runs every chunk pair (the kernel where it takes the
    pair's mask, else the reference); with `deterministic`
    each pair's backward adds dq in a fixed order, and the ring sums the pairs in one,
    so the gradients are bitwise reproducible.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    # The local chunks (and their segment ids, given together) checked as the caller
    # passed them: each pair's own call sees them cut by the band, and would name shapes
    # the caller never made.
    AttentionSpec.from_inputs(q, k, v, causal=False, softmax_scale=softmax_scale,
                              return_lse=return_lse, q_segment_ids=q_segment_ids,
                              kv_segment_ids=kv_segment_ids, deterministic=deterministic)
    left, right = _global_band(causal, window)
    # A window unbounded on both sides (as validated) is no band: any chunk lengths.
    if (left, right) != (None, None) and q.shape[1] != k.shape[1]:
        raise ValueError("causal or windowed ring attention needs query and key chunks of "
                         f"the same length; got q {q.shape} and k {k.shape}")
    halves = 2 if layout == "zigzag" else 1
    if q.shape[1] % halves or k.shape[1] % halves:
        raise ValueError(f"the zigzag layout needs even local lengths; got q {q.shape} "
                         f"and k {k.shape}")
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    length = q.shape[1] // halves

    def attend(q, k, v, window, q_seg, kv_seg):
        out, lse = attention(q, k, v, window=window, alignment="top_left",
                             softmax_scale=softmax_scale, return_lse=True,
                             implementation=implementation, q_segment_ids=q_seg,
                             kv_segment_ids=kv_seg, deterministic=deterministic)
        return out.astype(jnp.float32), lse

    def run(lo, hi, q, k, v, q_seg, kv_seg):
        cut = Cut.of(lo, hi)
        part = attend(cut.run_rows(q), cut.run_keys(k), cut.run_keys(v), cut.window,
                      cut.run_rows(q_seg), cut.run_keys(kv_seg))
        return cut.with_unseen(part, q, k, v)

    def hidden(q, k, v, q_seg, kv_seg):
        return vary_like((q, k, v), unseen(q, v))

    def split(x, axis=1):
        return [None] * halves if x is None else jnp.split(x, halves, axis=axis)

    q_parts, q_seg_parts = split(q), split(q_segment_ids)
    q_chunks = _chunk_ids(me, n, layout)
    causal_zigzag = halves == 2 and (left, right) == CAUSAL
    acc = [None] * halves
    for step in range(n):
        if step:  # one hop: device i sends its K/V (and their ids) to device i + 1
            k, v, kv_segment_ids = hop((k, v, kv_segment_ids), axis_name, n)
        if causal_zigzag:
            k_parts, v_parts, kv_seg_parts = (split(x) for x in (k, v, kv_segment_ids))
            for qi, ki, (lo, hi) in causal_zigzag_pairs(step, me):
                merge_picked(acc, qi, run(lo, hi, pick(q_parts, qi), pick(k_parts, ki),
                                          pick(v_parts, ki), pick(q_seg_parts, qi),
                                          pick(kv_seg_parts, ki)))
            continue
        kv_chunks = _chunk_ids((me - step) % n, n, layout)
        for k_part, v_part, kv_seg, c in zip(split(k), split(v), split(kv_segment_ids),
                                             kv_chunks):
            for i, (q_part, q_seg, a) in enumerate(zip(q_parts, q_seg_parts, q_chunks)):
                part = chunk_pair((left, right), length, n * halves, a, c, run, hidden,
                                  q_part, k_part, v_part, q_seg, kv_seg)
                acc[i] = part if acc[i] is None else merge(acc[i], part)
    out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
    lse = jnp.concatenate([l for _, l in acc], axis=2)
    return (out, lse) if return_lse else out


def _global_band(causal, window):
    """(left, right) of the band over global positions, validated like `attention`'s."""
    spec_causal, left, right = band(causal, window)
    return left, 0 if spec_causal else right


def zigzag(x, n: int, axis: int = 1):
    """Reorder a global sequence axis so that n contiguous shards are the zigzag layout:
    shard r holds chunks r and 2n-1-r of the original 2n chunks."""
    chunks = _chunks(x, n, axis)
    return jnp.concatenate([c for r in range(n) for c in (chunks[r], chunks[2 * n - 1 - r])],
                           axis=axis)


def unzigzag(x, n: int, axis: int = 1):
    """Inverse of `zigzag`."""
    chunks = _chunks(x, n, axis)
    order = [None] * (2 * n)
    for r in range(n):
        order[r], order[2 * n - 1 - r] = chunks[2 * r], chunks[2 * r + 1]
    return jnp.concatenate(order, axis=axis)


def _chunk_ids(device, n, layout):
    return (device,) if layout == "contiguous" else (device, 2 * n - 1 - device)


def _chunks(x, n: int, axis: int) -> list:
    """The 2n equal chunks of x along `axis`."""
    if x.shape[axis] % (2 * n):
        raise ValueError(f"the zigzag layout cuts axis {axis} into 2n = {2 * n} equal "
                         f"chunks (n = {n} devices); its length {x.shape[axis]} is not a "
                         f"multiple of {2 * n}")
    return jnp.split(x, 2 * n, axis=axis)
