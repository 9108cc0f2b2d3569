"""Which keys each query row sees: the aligned band (causal / window), segments, lengths.

Positions index the key axis. Each query row i is aligned with a key position a(i):

    bottom_right: a(i) = i + Lk - Lq   (the last valid query meets the last valid key)
    top_left:     a(i) = i

with Lq, Lk the valid lengths of the row's sequence (Sq, Sk unless q_lengths / kv_lengths
are given; per sequence in varlen). Query i sees key j iff

    a(i) - left <= j <= a(i) + right   (a side that is None is unbounded; causal: right = 0)
    and segment(i) == segment(j)       (segment ids, or the sequence index in varlen)
    and both i and j are valid         (i < q_lengths, j < kv_lengths; inside a sequence)

Positions are never reset by segment ids (packed self-attention, where query and key
segments coincide, needs no reset); varlen positions are per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Visibility(NamedTuple):
    mask: jax.Array | None  # bool (..., Sq, Sk); None: every query sees every key
    q_valid: jax.Array | None  # bool (..., Sq): rows that are queries; None: all are


def padded(sq: int, sk: int, *, causal: bool, alignment: str, window, q_segment_ids=None,
           kv_segment_ids=None, q_lengths=None, kv_lengths=None) -> Visibility:
    """Visibility for padded batches: segment ids (..., Sq) / (..., Sk), lengths (...,)."""
    left, right = _band_sides(causal, window)
    q_idx = jnp.arange(sq, dtype=jnp.int32)
    k_idx = jnp.arange(sk, dtype=jnp.int32)
    q_valid = None if q_lengths is None else q_idx < q_lengths[..., None]
    k_valid = None if kv_lengths is None else k_idx < kv_lengths[..., None]
    band = None
    if left is not None or right is not None:
        aligned = q_idx
        if alignment == "bottom_right":
            q_len = sq if q_lengths is None else jnp.clip(q_lengths, 0, sq)
            k_len = sk if kv_lengths is None else jnp.clip(kv_lengths, 0, sk)
            aligned = q_idx + jnp.asarray(k_len - q_len, jnp.int32)[..., None]
        band = _band(aligned, k_idx, left, right)
    same = None
    if q_segment_ids is not None:
        same = q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]
    return Visibility(_all(band, same, *_pairs(q_valid, k_valid)), q_valid)


def varlen(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, causal: bool,
           alignment: str, window) -> Visibility:
    """Visibility for packed sequences: sequence s holds rows cu[s] <= i < cu[s + 1].

    Rows outside every sequence (before cu[0], from cu[-1] on) are invalid. cu_seqlens
    must be non-decreasing and inside [0, total] (`clip_offsets` makes them so).
    """
    q_seq, q_valid = sequence_index(cu_seqlens_q, total_q)
    k_seq, k_valid = sequence_index(cu_seqlens_k, total_k)
    left, right = _band_sides(causal, window)
    band = None
    if (left is not None or right is not None) and cu_seqlens_q.shape[0] > 1:
        q_idx = jnp.arange(total_q, dtype=jnp.int32)
        s = jnp.clip(q_seq, 0, cu_seqlens_q.shape[0] - 2)  # any sequence for invalid rows
        if alignment == "bottom_right":  # i - cu_q[s] + Lk - Lq, in global key indices
            aligned = q_idx + cu_seqlens_k[s + 1] - cu_seqlens_q[s + 1]
        else:
            aligned = q_idx - cu_seqlens_q[s] + cu_seqlens_k[s]
        band = _band(aligned, jnp.arange(total_k, dtype=jnp.int32), left, right)
    same = q_seq[:, None] == k_seq[None, :]
    return Visibility(_all(band, same, *_pairs(q_valid, k_valid)), q_valid)


def clip_lengths(lengths, size: int):
    """Runtime lengths as every path reads them: clipped to [0, size]. Under jit their
    values cannot be checked, so any int32 has this meaning. None stays None."""
    return None if lengths is None else jnp.clip(lengths, 0, size)


def clip_offsets(cu_seqlens, total: int):
    """Runtime cu_seqlens as every path reads them: each offset clipped to [0, total],
    then raised to the largest offset before it (a running maximum). An offset past the
    packed length ends its sequence at the end; a decreasing one makes an empty
    sequence. Any int32 values thus mean non-decreasing offsets inside the axis."""
    return lax.cummax(jnp.clip(cu_seqlens, 0, total))


def _band_sides(causal: bool, window) -> tuple[int | None, int | None]:
    left, right = (None, None) if window is None else window
    return left, (0 if causal else right)


def _band(aligned, k_idx, left, right):
    """bool (..., Sq, Sk): aligned - left <= j <= aligned + right."""
    offset = k_idx - aligned[..., :, None]
    parts = []
    if left is not None:
        parts.append(offset >= -left)
    if right is not None:
        parts.append(offset <= right)
    return _all(*parts)


def sequence_index(cu_seqlens, total: int):
    """(sequence of each row, whether it lies inside one) for rows 0 .. total - 1."""
    rows = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, rows, side="right").astype(jnp.int32) - 1
    return seq, (seq >= 0) & (seq < cu_seqlens.shape[0] - 1)


def _pairs(q_valid, k_valid):
    return (None if q_valid is None else q_valid[..., :, None],
            None if k_valid is None else k_valid[..., None, :])


def _all(*masks):
    """Logical AND of the masks that are not None (broadcasting); None if all are."""
    result = None
    for mask in masks:
        if mask is not None:
            result = mask if result is None else result & mask
    return result
